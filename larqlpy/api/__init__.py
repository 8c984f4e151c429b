"""The Python API: `larqlpy.load(path)` -> `Model` (model.py), and a conversation that keeps its
attention state across turns (`ChatSession`, chat.py). Both go through the request pipeline."""
