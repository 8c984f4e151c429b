"""Load a model of any supported family: a Hugging Face-layout directory (config.json, safetensors,
single or sharded, tokenizer, the key calibration) or a .gguf file run directly; low-bit weight formats
come packed from the packed-weight cache, a GGUF's own codes straight from its blocks."""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import reduce
from pathlib import Path

import torch
import xxhash
from safetensors import safe_open

from larqlpy.engines.geometry import check_kv_dtype, default_kv_dtype
from larqlpy.engines.stores.calibration import KeyCalibration
from larqlpy.errors import LarqlError
from larqlpy.kernels import ahead
from larqlpy.kernels.weights import prefetch
from larqlpy.kernels.weights.qweight import PackedPart, PackedWeight, check_format, stack
from larqlpy.model.config import ModelConfig
from larqlpy.model.decoder import Decoder
from larqlpy.model.families import read_config
from larqlpy.model.shaped_tensors import top_matrices
from larqlpy.model.tensors import block_weights, head_matrices, matrix_groups, top_weights
from larqlpy.text.tokenizer import Tokenizer
from larqlpy.text.tokenizer_process import TokenizerProcess
from larqlpy.weights import calibration_file, native_file, packed_cache
from larqlpy.weights.checkpoint import Checkpoint, view_array, view_of
from larqlpy.weights.gguf_checkpoint import GGUFCheckpoint, GGUFCodes, default_weights
from larqlpy.weights.gguf_file import open_gguf
from larqlpy.weights.known_files import KnownFiles
from larqlpy.weights.mxfp4_checkpoint import MXFP4, MXFP4Checkpoint, open_checkpoint
from larqlpy.weights.native_file import NativeFile


@dataclass
class LoadedModel:
    path: Path
    config: ModelConfig
    model: Decoder
    tokenizer: Tokenizer
    fingerprint: str  # config + weight file headers: what a saved state must match
    weights: str = "f32"  # f32 | bf16 | int8 | int4 | native: the precision the matrices run at
    # low-bit formats: "cache", "built" (weights/packed_cache.py) or "file" (unpacked from a GGUF's blocks)
    packed_from: str | None = None
    weights_digest: str | None = None  # of every byte the weights were read from (the fingerprint samples them)
    home: Path | None = None  # where config, tokenizer, calibration and caches live: path, or a GGUF's metadata cache
    files_digest: str | None = None  # of every byte of the checkpoint's own files: what a key calibration must match
    draft: "LoadedModel | None" = None  # a smaller model of the same vocabulary, proposing ids (decode/speculate.py)
    draft_tokens: int | None = None  # its proposals a step, for requests that do not say (None: the default)
    float_fallback: dict | None = None  # a GGUF's matrices `native` reads as float32 (GGUFCheckpoint.float_fallback)

    def held_weights(self) -> list:
        """Every weight as the model holds it: float tensors, packed matrices (not nn.Parameters), and
        the stacked matrix behind packed q|k|v and gate|up once."""
        m = self.model
        held = [getattr(m, n) for n in top_weights(m.cfg)] + [m.head] + \
            [reduce(getattr, n.split("."), b) for i, b in enumerate(m.layers)
             for n in block_weights(m.cfg, i)]  # experts.{j}.gate_proj
        return list({id(w): w for w in (w.whole if isinstance(w, PackedPart) else w for w in held)}.values())

    @property
    def weight_bytes(self) -> int:
        """Bytes the weights take on their device (packed matrices at their packed size)."""
        return sum(w.nbytes for w in self.held_weights())

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def kv_dtype(self) -> str:
        return self.model.kv_dtype


def load(path: str | Path, device: str = "auto", dtype: str = "float32", weights: str | None = None,
         kv_dtype: str | None = None, key_calibration: bool = True, tokenizer: TokenizerProcess | None = None,
         allow_unused_tensors: bool = False, pre_tokenizer: str | None = None) -> LoadedModel:
    """Load a model: a directory in the HF layout, or a .gguf file run directly (its metadata cached
    beside it: weights/gguf_file.py). device: auto|cpu|cuda; dtype: float32|bfloat16 (activations);
    weights: what the files hold when None (a GGUF's own codes, a bf16 checkpoint's bf16, else f32);
    f32|bf16|int8|int4 -- the matrices (embedding / tied LM head included) packed, from the
    packed-weight cache after the first load; native -- each matrix as the GGUF held it (unpacked
    from a .gguf's blocks at every load; a converted directory's native.safetensors);
    kv_dtype: f32|f16|bf16, what the engines keep exact K/V rows in (None: f32 beside f32 weights,
    else f16);
    key_calibration: read kv_calibration.safetensors when the model has one (a stale or damaged one
    is reported on the model, not raised); tokenizer: a helper already loading it
    (tokenizer_process.start), else it is loaded here; allow_unused_tensors: load weight files that
    hold tensors the family does not take (refused otherwise: a config.json over another family's
    weights); pre_tokenizer: a GGUF's text split as this llama.cpp name does, not as its file says.
    Every weight read is checked finite (a file unchanged since it passed once is not read again:
    known_files.py); a NaN or infinity is refused naming its tensor."""
    path = Path(path)
    if weights is not None:
        check_format(weights)
    check_kv_dtype(kv_dtype)
    dev = resolve_device(device)
    tdtype = resolve_dtype(dtype)
    gguf = open_gguf(path, pre_tokenizer=pre_tokenizer)
    home = path if gguf is None else gguf.dir  # config, tokenizer, calibration and caches
    cfg = read_config(home)
    tokenizer = Tokenizer.from_dir(home, cfg) if tokenizer is None else tokenizer.tokenizer()
    ckpt = open_checkpoint(path, cfg, allow_unused_tensors) if gguf is None else \
        GGUFCheckpoint(gguf, cfg, allow_unused_tensors)
    weights = weights or default_weights(ckpt)
    model = Decoder(cfg, device=dev, dtype=tdtype)
    model.kv_dtype = kv_dtype or default_kv_dtype(weights)
    packed_from, matrices = None, set()
    handles: dict[Path, object] = {}
    checks = KnownFiles(packed_cache.cache_dir(home))
    direct = isinstance(ckpt, GGUFCheckpoint)
    own_codes = direct or isinstance(ckpt, MXFP4Checkpoint)  # `native` from the weight files themselves
    reads = [*ckpt.handles, *([path / native_file.FILE] if weights == "native" and not own_codes else [])]
    sources = {f.name: checks.digest(f) for f in reads if f.is_file()}  # from the record while unchanged
    _compile_ahead(ckpt, dev, cfg.head_dim, weights == "native" and own_codes)
    if weights == "native" and own_codes:  # unpacked from the file's blocks: nothing kept on disk
        matrices = _install_packed(model, _pack_native(ckpt, ckpt.native(gather=dev.type == "cpu"), cfg), dev)
        packed_from = "file"
    elif weights != "f32":
        build = (lambda: _pack_native(ckpt, NativeFile(path, ckpt.fingerprint), cfg)) if weights == "native" else \
            (lambda: _pack(ckpt, handles, checks, cfg, weights))
        packed, packed_from = packed_cache.load_or_build(home, weights, ckpt.fingerprint, sources, build)
        matrices = _install_packed(model, packed, dev)
    _install_floats(model, ckpt, handles, checks, matrices, dev, tdtype)
    checks.record()
    own = _digest({f.name: sources[f.name] for f in ckpt.handles if f.name in sources})  # whatever `weights`
    if key_calibration:
        _read_calibration(model, home, ckpt.fingerprint, own)
    return LoadedModel(path, cfg, model, tokenizer, ckpt.fingerprint, weights, packed_from, _digest(sources), home,
                       own, float_fallback=ckpt.float_fallback() if weights == "native" and direct else None)


def _install_floats(model: Decoder, ckpt, handles: dict, checks: KnownFiles, packed: set, dev: torch.device,
                    tdtype: torch.dtype) -> None:
    """Every weight not among the `packed` matrices onto the model as a float Parameter, each checked
    finite as it is read."""
    for ours, (hf, _) in ckpt.wanted.items():
        if ours in packed:
            continue
        if ckpt.dtypes[ours] == "F32" and dev.type == "cpu" and tdtype == torch.float32:
            tensor = _float32(ckpt, handles, checks, ours)  # zero-copy from the file's pages, shared between processes
        else:
            tensor = _tensor(ckpt, handles, ours)
            checks.check(ckpt.files[hf], hf, tensor.float().numpy())
        owner, _, attr = ours.rpartition(".")
        setattr(model.get_submodule(owner), attr,
                torch.nn.Parameter(tensor.to(device=dev, dtype=tdtype), requires_grad=False))


def _digest(sources: dict) -> str:
    return xxhash.xxh3_128_hexdigest(json.dumps(sources, sort_keys=True).encode())


def _read_calibration(model: Decoder, home: Path, fingerprint: str, files_digest: str) -> None:
    """The model's key calibration from kv_calibration.safetensors, when it has a usable one; else
    why not, on the model (a stale or damaged file is reported, not raised)."""
    c = model.cfg
    layers, model.calibration_problem = calibration_file.read_any(
        home, c.num_hidden_layers, *calibration_file.head_shapes(c), fingerprint, files_digest)
    if layers is not None:
        model.key_calibration = [KeyCalibration.of(torch.from_numpy(m), torch.from_numpy(s),
                                                   None if t is None else torch.from_numpy(t), model.rope_freq(i))
                                 for i, (m, s, t) in enumerate(layers)]


def _tensor(ckpt: Checkpoint | GGUFCheckpoint, handles: dict, ours: str) -> torch.Tensor:
    """A weight in memory, in its file's dtype (a GGUF's dequantized to float32)."""
    if isinstance(ckpt, GGUFCheckpoint) or ckpt.dtypes[ours] == MXFP4:  # dequantized from the file's codes
        return torch.from_numpy(ckpt.mapped(ours))
    hf = ckpt.wanted[ours][0]
    return _read_tensor(handles, ckpt.files[hf], hf)


def _read_tensor(handles: dict, file: Path, hf: str) -> torch.Tensor:
    """A tensor in any safetensors dtype (bf16 and f16 included), copied into memory."""
    try:
        if file not in handles:
            handles[file] = safe_open(str(file), framework="pt")
        base = view_of(hf)[0]
        t = handles[file].get_tensor(base)
        return t if base == hf else view_array(hf, t).contiguous()
    except Exception as e:
        raise LarqlError(f"{file}: cannot read tensor {hf} ({str(e).splitlines()[0]})") from None


def _float32(ckpt: Checkpoint, handles: dict, checks: KnownFiles, ours: str) -> torch.Tensor:
    """A weight as float32, checked finite: zero-copy when the file holds float32."""
    hf = ckpt.wanted[ours][0]
    file = ckpt.files[hf]
    a = ckpt.mapped(ours) if ckpt.dtypes[ours] == "F32" else _tensor(ckpt, handles, ours).float().numpy()
    checks.check(file, hf, a)
    return torch.from_numpy(a)


def _pack(ckpt: Checkpoint, handles: dict, checks: KnownFiles, cfg: ModelConfig, fmt: str) -> dict[str, PackedWeight]:
    """Every matrix packed from float32 on the CPU (the same codes on every device): q|k|v and
    gate|up stacked into one matrix each, so decode calls one kernel per group."""
    out = {name: PackedWeight.quantize(_float32(ckpt, handles, checks, name), fmt, name)
           for name in ("embed_tokens", "lm_head", *top_matrices(cfg)) if name in ckpt.wanted}
    for i in range(cfg.num_hidden_layers):
        for owner, names in matrix_groups(cfg, i):
            key = f"layers.{i}.{owner}{'|'.join(names)}"
            ws = [_float32(ckpt, handles, checks, f"layers.{i}.{owner}{n}") for n in names]
            out[key] = stack(ws, fmt, key)[0].whole if len(ws) > 1 else PackedWeight.quantize(ws[0], fmt, key)
    return out


def _pack_native(ckpt: Checkpoint | GGUFCheckpoint, native: NativeFile | GGUFCodes,
                 cfg: ModelConfig) -> dict[str, PackedWeight]:
    """The GGUF's own codes, tiled; q|k|v and gate|up stacked where their codes share one format.
    Matrices the file holds as float stay out (they load as float32)."""
    def hf(ours: str) -> str | None:
        name = ckpt.wanted[ours][0]
        return name if name in native.matrices else None

    out = {}
    for name in [n for n in ("embed_tokens", "lm_head", *top_matrices(cfg)) if n in ckpt.wanted]:
        if hf(name) is not None:  # only gathered from, one row a token: an untied embedding, the per-layer table
            gathered = name == "embed_tokens_per_layer" or name == "embed_tokens" and "lm_head" in ckpt.wanted
            out[name] = native.table(hf(name)) if gathered else native.pack([hf(name)])
    for i in range(cfg.num_hidden_layers):
        for owner, names in matrix_groups(cfg, i):  # a single matrix is a stack of one
            prefix = f"layers.{i}.{owner}"
            out.update(_stacks(native, [(n, hf(prefix + n)) for n in names], prefix))
        for name in head_matrices(cfg, i):  # per head, one matrix of every head's rows (model/mla.py)
            if hf(f"layers.{i}.{name}") is not None:
                out[f"layers.{i}.{name}"] = native.pack([hf(f"layers.{i}.{name}")])
    return out


def _compile_ahead(ckpt: Checkpoint | GGUFCheckpoint, dev: torch.device, head: int, own_codes: bool) -> None:
    """On a cold kernel cache, a second process compiles what this load and run will need
    (kernels/ahead.py): the products of a file's own codes, on the CPU. Every load says so, nothing
    included, so a helper the command began early does not wait out a server's life for its jobs."""
    ahead.start(ahead.plan(ckpt.dtypes.values(), head) if own_codes and dev.type == "cpu" else [])


def _stacks(native: NativeFile | GGUFCodes, parts: list[tuple[str, str | None]], prefix: str) -> dict:
    """Matrices reading one input, packed as runs of neighbours that share a kind (each at its file's
    own width: a Q8_0 v_proj beside Q5_0 q_proj and k_proj stacks q|k and packs v alone); a matrix
    held as float (None) stays out."""
    out, run = {}, []
    for name, hf in parts + [("", None)]:
        if run and (hf is None or native.kind(hf) != native.kind(run[-1][1])):
            out[prefix + "|".join(n for n, _ in run)] = native.pack([h for _, h in run])
            run = []
        if hf is not None:
            run.append((name, hf))
    return out


def _install_packed(model: Decoder, packed: dict[str, PackedWeight], dev: torch.device) -> set[str]:
    """Put packed matrices in place of the float ones; returns the names (ours) they replace. Their
    prefetch distance is this machine's for their size (kernels/weights/prefetch.py), measured by a later run
    while a helper process compiles (kernels/ahead.py)."""
    done, installed = set(), []
    for key, w in packed.items():
        owner, _, attr = key.rpartition(".")
        module = model.get_submodule(owner) if owner else model
        whole, lo = w.to(dev), 0
        names = attr.split("|")
        for n in names:  # a stack: each part is a row range of the whole
            rows = getattr(module, n).shape[0]
            module._parameters.pop(n)
            setattr(module, n, whole if len(names) == 1 else PackedPart(whole, lo, lo + rows))
            lo += rows
            done.add(f"{owner}.{n}" if owner else n)
        installed.append(whole)
    if not ahead.busy():  # else measured by the next run, on a machine not compiling: prefetching changes no number
        prefetch.choose(installed)
    return done


def load_with_draft(path: str | Path, draft: str | Path | None = None, draft_tokens: int | None = None,
                    draft_weights: str | None = None, **kw) -> LoadedModel:
    """`load(path, **kw)`, and with `draft` a draft model beside it: on the same device, its exact
    K/V rows in the target's dtype, its weights `draft_weights` (None: what its own files hold;
    `load`'s `weights`); `draft_tokens`: its proposals a step for requests that do not say."""
    if draft_weights is not None:  # before any weights load
        if draft is None:
            raise LarqlError("`draft_weights` needs `draft`")
        check_format(draft_weights, "draft_weights")
    loaded = load(path, **kw)
    if draft is None:
        return loaded
    loaded.draft_tokens = draft_tokens  # checked where it came in, as a request's `draft_tokens`
    return attach_draft(loaded, load(draft, device=str(loaded.device.type), dtype=kw.get("dtype", "float32"),
                                     weights=draft_weights, kv_dtype=loaded.kv_dtype))


def attach_draft(loaded: LoadedModel, draft: LoadedModel) -> LoadedModel:
    """`loaded` with `draft` as its draft model: refused unless the two tokenizers give every id the
    same token (a proposal is an id, verified as the target's)."""
    a, b = vocabulary(loaded.tokenizer), vocabulary(draft.tokenizer)
    if a != b:
        differ = next((t for t in sorted(a.keys() ^ b.keys())), None) or \
            next(t for t in sorted(a) if a[t] != b.get(t))
        raise LarqlError(f"the draft model {draft.path.name} has another vocabulary than {loaded.path.name} "
                         f"({len(b):,} tokens against {len(a):,}; {differ!r} differs): a draft must share the "
                         "target's tokenizer")
    if draft.model.device != loaded.model.device:
        raise LarqlError("the draft model must run on the target's `device`")
    loaded.draft = draft
    return loaded


def vocabulary(tokenizer) -> dict[str, int]:
    """Every token of a tokenizer and its id, added tokens included (a helper process's too)."""
    raw = json.loads(tokenizer.to_json())
    vocab = raw["model"]["vocab"]
    vocab = dict(vocab) if isinstance(vocab, dict) else {piece: i for i, (piece, _) in enumerate(vocab)}  # Unigram
    vocab.update({t["content"]: t["id"] for t in raw.get("added_tokens", [])})
    return vocab


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise LarqlError("`device` cuda: no CUDA device available")
    if device not in ("cpu", "cuda"):
        raise LarqlError(f"`device`: expected auto, cpu or cuda, got {device!r}")
    return torch.device(device)


def resolve_dtype(dtype: str) -> torch.dtype:
    table = {"float32": torch.float32, "bfloat16": torch.bfloat16}
    if dtype not in table:
        raise LarqlError(f"`dtype`: expected float32 or bfloat16, got {dtype!r}")
    return table[dtype]
