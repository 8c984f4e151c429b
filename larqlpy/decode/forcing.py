"""A thinking budget: a model's reasoning block (text/reasoning.py) held to at most N tokens. Past
them the sequence closes the block itself -- the ids of its closing text (`Markers.forced_close`,
"\\n</think>\\n\\n") are forced one by one, as the model's own tokens -- and the model goes on with
its answer. The forcing is a mask on the logits (decode/logits.py applies it after the grammar's),
so sampling, speculation's verification and log-probabilities treat a forced id as any other.

The block is followed in text, as the splitter reads it: it begins where the output's first
non-blank text is the opening marker (or at once, where the prompt opened it), and its tokens are
counted from the one after the marker's; the closing marker written by the model ends it.
"""

from __future__ import annotations

from larqlpy.text.reasoning import Reasoning


class ThinkingBudget:
    """One sequence's reasoning block, counted; the id that must come next once it is spent."""

    def __init__(self, tokenizer, reasoning: Reasoning, budget: int):
        self.markers, self.budget = reasoning.markers, budget
        self.detokenizer = tokenizer.stream()
        self.closing = tokenizer.ids_of(self.markers.forced_close)
        self.state = "inside" if reasoning.opened else "head"  # head: not known yet; done: nothing to force
        self.text = ""  # the output's text while undecided, then the block's
        self.spent = 0  # tokens inside the block
        self.queue: list[int] = []  # closing ids still to force
        self.refused = False  # the grammar did not allow the closing text: the grammar owns the output

    def forced(self) -> int | None:
        """The id the next token must be, or None."""
        if self.state == "inside" and self.spent >= self.budget and not self.queue:
            self.queue, self.state = list(self.closing), "closing"
        return self.queue[0] if self.queue else None

    def refuse(self) -> None:
        """The grammar does not allow the forced id: the block is left to the model and its grammar."""
        self.queue, self.state, self.refused = [], "done", True

    def accept(self, tok: int) -> None:
        """`tok` was sampled (or forced)."""
        if self.state == "done":
            return
        if self.state == "closing":
            self.queue = self.queue[1:] if self.queue and self.queue[0] == tok else []
            self.state = "closing" if self.queue else "done"
            return
        self.text += self.detokenizer.step(tok)
        if self.state == "head":
            head = self.text.lstrip()
            if not head or (self.markers.open.startswith(head) and head != self.markers.open):
                return
            if not head.startswith(self.markers.open):
                self.state = "done"  # no block: the output is an answer
                return
            self.text, self.state = head[len(self.markers.open):], "inside"
            return  # the marker's token is not reasoning
        self.spent += 1
        if self.markers.close in self.text:
            self.state = "done"
        self.text = self.text[-len(self.markers.close):]  # a marker split across tokens is still found
