"""Weights of a model built on the meta device: computed buffers, `load` from a checkpoint, `init_weights`.

`autopar.parallelize(model_on_meta, mesh, example_inputs)` captures and plans without materialising anything;
`ParallelModule` then allocates only each rank's shard of every parameter (`dtensors.empty_like_placed`),
uninitialised, and refuses to run until one of these fills them:

- `load(pm, path)`: a Hugging Face checkpoint directory (`model.safetensors`, or shards listed in
  `model.safetensors.index.json`): each rank reads only its slice of each tensor (`safe_open(...).get_slice`,
  one read per contiguous run of rows: a fused-QKV `_StridedShard` is one run per part; an expert under expert
  parallelism only on its owners), so a rank's memory while loading stays near its shards. Checkpoint keys
  are the model's parameter names without the user's wrapper prefix (`model.layers.0...` for
  `m.model.layers.0...`): the prefix is found as the one that matches the most names, or given as `prefix=`.
  Tied weights are read once. Keys are first renamed as `from_pretrained` renames them for the model's Hugging
  Face class (transformers' conversion mapping, `_converted_keys`); a tensor a converter stacks and concatenates
  from several (Mixtral's per-expert `w1`/`w3` into `gate_up_proj`) is read piece by piece, each rank reading only
  the pieces its shard holds (`_fill_converted`; bytes per checkpoint key in `pm._bytes_read`). A name the model
  needs and the checkpoint lacks, or (with `strict`) one the checkpoint has and the model does not, is an error
  listing them. Tensors are cast to the parameter's dtype.
  Or a `torch.distributed.checkpoint` directory (from `dcp.save(pm.state_dict(), ...)`, under any plan or mesh):
  DCP reads each rank's shards into `pm.state_dict()`.
- `init_weights(pm)`: the model's own initialisation on the shards: Hugging Face `_init_weights` of the nearest
  `PreTrainedModel` for each submodule, else its `reset_parameters()` / `init_weights()`. Each parameter is
  initialised alone (its module's other parameters stand in as meta tensors) from a generator seeded by
  (seed, parameter name, which shard this rank holds): ranks holding the same shard draw the same values,
  different shards draw independently, and fan-in/out come from the DTensor's global shape. The result is
  equal in distribution to initialising on one device, not bit for bit. A parameter left (partly) unset is an
  error; a write through an index of a sharded parameter lands in DTensor's redistributed copy, so the one
  such write initialisations make, an embedding's zero padding row, is applied to the shard holding the row.

Buffers: persistent ones are loaded like parameters (or set by the initialisation); non-persistent ones (RoPE's
`inv_freq`) are computed on each rank when the ParallelModule is built (`compute_buffers`): by the owning
Hugging Face model's `_init_weights` (which computes rotary tables from the config), else an error naming the
buffer and how to build it off the meta device.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
from pathlib import Path

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from autopar.dtensors import local_indices

__all__ = ["load", "init_weights", "compute_buffers", "is_meta_model"]


def is_meta_model(model: nn.Module) -> bool:
    return any(t.is_meta for t in model.parameters()) or any(b.is_meta for b in model.buffers())


def meta_copy(model: nn.Module) -> nn.Module:
    """A copy of `model`'s structure with every parameter and buffer on the meta device (shapes, dtypes,
    `requires_grad`, tied weights and non-persistent buffers kept, gradients dropped): what re-capture needs
    (`autopar.relower`), holding none of the model's parameter or buffer storage. Other tensor attributes (the
    forward's constants, e.g. a mask kept as a plain attribute) are the model's own tensors, shared, not copied.
    Made without copying any data: each tensor is replaced in `deepcopy`'s memo before the copy runs."""
    from torch.distributed._local_tensor import maybe_disable_local_tensor_mode
    memo: dict[int, object] = {}
    with maybe_disable_local_tensor_mode():  # plain meta tensors, also for a model built under LocalTensorMode
        for p in model.parameters():
            memo[id(p)] = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"),
                                       requires_grad=p.requires_grad)
        for b in model.buffers():
            memo[id(b)] = torch.empty(b.shape, dtype=b.dtype, device="meta")
    for mod in model.modules():
        for v in vars(mod).values():
            if isinstance(v, torch.Tensor) and id(v) not in memo:
                memo[id(v)] = v
    return copy.deepcopy(model, memo)


# ----------------------------------------------------------------------------- buffers


def _hf_owners(model: nn.Module) -> dict[int, nn.Module]:
    """For each submodule, the nearest enclosing Hugging Face `PreTrainedModel` (as HF's `smart_apply`)."""
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return {}
    owners: dict[int, nn.Module] = {}

    def walk(mod, owner):
        if isinstance(mod, PreTrainedModel):
            owner = mod
        if owner is not None:
            owners[id(mod)] = owner
        for child in mod.children():
            walk(child, owner)

    walk(model, None)
    return owners


def _standin(mod: nn.Module, params: dict, buffers: dict) -> nn.Module:
    """A shallow copy of `mod` whose own parameters and buffers are replaced (the user's module is untouched)."""
    clone = copy.copy(mod)
    clone._parameters = {**mod._parameters, **params}
    clone._buffers = {**mod._buffers, **buffers}
    return clone


def compute_buffers(model: nn.Module, device: torch.device) -> dict[str, torch.Tensor]:
    """Every non-persistent buffer left on the meta device, computed on `device` by its module's initialisation."""
    owners = _hf_owners(model)
    out: dict[str, torch.Tensor] = {}
    for path, mod in model.named_modules():
        todo = {n: b for n, b in mod._buffers.items()
                if b is not None and b.is_meta and n in mod._non_persistent_buffers_set}
        if not todo:
            continue
        fresh = {n: torch.full_like(b, float("nan"), device=device) if b.is_floating_point()
                 else torch.empty_like(b, device=device) for n, b in todo.items()}
        owner = owners.get(id(mod))
        if owner is not None:
            with torch.no_grad():
                owner._init_weights(_standin(mod, {}, fresh))
        computed = {n: t for n, t in fresh.items() if t.is_floating_point() and not t.isnan().any()}
        missing = sorted(set(todo) - set(computed))
        if missing:
            name = f"{path}.{missing[0]}" if path else missing[0]
            raise NotImplementedError(
                f"buffer {name} ({type(mod).__name__}) is non-persistent and on the meta device: it is not in "
                "checkpoints, and autopar computes such buffers only through a Hugging Face model's _init_weights. "
                f"Fix: build {type(mod).__name__} on the CPU (its buffers are small), e.g. construct the model under "
                f"torch.device('meta') and then replace model.{path or '<module>'} by one built off the meta device.")
        for n, t in computed.items():
            out[f"{path}.{n}" if path else n] = t
    return out


# ----------------------------------------------------------------------------- load


def load(pm, path, *, prefix: str | None = None, strict: bool = True):
    """Fill a ParallelModule's parameters and persistent buffers from checkpoint directory `path`: Hugging Face
    safetensors (each rank reads only its slices) or torch.distributed.checkpoint. Returns `pm`.

    Every rank reads its own files (a node may lack one, or hold a corrupt copy): the reading is followed by one
    all-gather of a failed flag (`agree_on_success`), so a failure on any rank raises on every rank, naming the
    rank and the file, instead of leaving the others waiting in the next collective. On failure nothing is marked
    filled: the module still refuses to run."""
    from autopar.agree import agree_on_success
    path = Path(path)
    filled = agree_on_success(lambda: _read(pm, path, prefix, strict), pm.mesh, "in autopar.load")
    if filled is None:  # dcp.load's own collectives gather its ranks' errors (a CheckpointException on every rank)
        _load_dcp(pm, path)
    else:
        pm._unfilled -= filled  # only once every rank has read its slices: the ranks run, or refuse, alike
    return pm


def _on_rank() -> str:
    import torch.distributed as dist
    return f" on rank {dist.get_rank()}" if dist.is_initialized() and dist.get_world_size() > 1 else ""


def _read(pm, path: Path, prefix: str | None, strict: bool) -> set[str] | None:
    """What one rank does alone: find the checkpoint, and read safetensors into its shards, returning the names
    filled; a torch.distributed.checkpoint: check its shapes only (its reading is collective), returning None."""
    if not path.is_dir():
        raise FileNotFoundError(f"autopar.load{_on_rank()} needs a checkpoint directory, got {str(path)!r}, which is "
                                "not one. Fix: pass the directory written by save_pretrained(...) or dcp.save(...), "
                                "present at the same path on every node.")
    if (path / ".metadata").exists():
        _check_dcp_shapes(pm.state_dict(), _dcp_metadata(path), path)
        return None
    if list(path.glob("*.safetensors")):
        return _load_safetensors(pm, path, prefix, strict)
    raise ValueError(f"{path} holds neither safetensors files (*.safetensors) nor a torch.distributed.checkpoint "
                     f"(.metadata){_on_rank()}. Fix: pass the directory written by save_pretrained(...) or "
                     "dcp.save(...), present at the same path on every node.")


def _dcp_metadata(path: Path):
    import torch.distributed.checkpoint as dcp
    try:
        return dcp.FileSystemReader(str(path)).read_metadata()
    except Exception as e:
        raise ValueError(f"autopar.load{_on_rank()}: cannot read the torch.distributed.checkpoint metadata "
                         f"{str(path / '.metadata')!r} ({type(e).__name__}: {e}): the file is corrupt or truncated. "
                         "Fix: copy the checkpoint again from where it was saved (the same files on every node).") \
            from e


def _open(file: Path, listed: bool):
    """`safe_open(file)`, or an error naming this rank and the file: missing (on this node) or corrupt."""
    from safetensors import safe_open
    try:
        return safe_open(str(file), framework="pt", device="cpu")
    except FileNotFoundError as e:
        raise FileNotFoundError(
            f"autopar.load{_on_rank()}: checkpoint file {str(file)!r} is missing"
            + (" (model.safetensors.index.json lists it)" if listed else "")
            + ". Fix: copy the whole checkpoint directory to every node (each rank reads its slices from every "
            "file).") from e
    except Exception as e:  # safetensors' SafetensorError (a bad header, a truncated file), an OSError
        raise ValueError(
            f"autopar.load{_on_rank()}: checkpoint file {str(file)!r} is not a readable safetensors file "
            f"({type(e).__name__}: {e}): it is corrupt or truncated (an interrupted copy or download?). Fix: copy "
            "it again from where it was saved (the same files on every node).") from e


class _OneOpen:
    """The checkpoint file last asked for, kept open until another is asked for: the converted (stacked) MoE
    experts are read key by key, and one layer's experts sit in one file, so opening that file once per expert
    tensor (256 per layer at DeepSeek-V3's size, each parsing the file's header) was the cost. One file mapped at a
    time, as the plain keys' loop does."""

    def __init__(self, listed: bool, hf=None):
        self.listed, self.file, self.handle = listed, None, None
        self.hf = hf  # the Hugging Face model (transformers' conversions that need it or its config)
        self.converted = {}  # first target key -> [outputs, targets still to fill] of a one-to-many conversion

    def get(self, file: Path):
        if file != self.file:
            self.close()
            self.handle = _open(file, listed=self.listed).__enter__()
            self.file = file
        return self.handle

    def close(self) -> None:
        if self.handle is not None:
            handle, self.handle, self.file = self.handle, None, None
            handle.__exit__(None, None, None)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _load_dcp(pm, path: Path) -> None:
    import torch.distributed.checkpoint as dcp
    state = pm.state_dict()
    dcp.load(state, checkpoint_id=str(path))
    pm.load_state_dict(state)


def _check_dcp_shapes(state: dict, metadata, path: Path) -> None:
    """Every tensor the checkpoint holds for a name of `state` has that tensor's global shape (DCP itself raises a
    CheckpointException per rank with the sizes deep inside it). Every rank reads the same metadata: every rank
    raises alike."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    saved = metadata.state_dict_metadata
    wrong = [(k, tuple(saved[k].size), tuple(v.shape)) for k, v in state.items()
             if isinstance(v, torch.Tensor) and isinstance(saved.get(k), TensorStorageMetadata)
             and tuple(saved[k].size) != tuple(v.shape)]
    if wrong:
        (name, theirs, mine), more = wrong[0], len(wrong) - 1
        raise ValueError(
            f"autopar.load: the torch.distributed.checkpoint in {str(path)!r} holds {name} with shape {theirs}, but "
            f"this model's {name} has shape {mine}" + (f" (and {more} more parameters differ: "
                                                      f"{', '.join(k for k, _, _ in wrong[1:4])}"
                                                      f"{', ...' if more > 3 else ''})" if more else "")
            + ": it was saved from a model of another shape (another config). Fix: build the model with the config "
            "the checkpoint was saved from, or load a checkpoint of this model.")


def _safetensors_index(path: Path) -> dict[str, Path]:
    """Checkpoint key -> file holding it."""
    index = path / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"autopar.load{_on_rank()}: {str(index)!r} is not a safetensors index (a JSON object "
                             f"with a 'weight_map'): {type(e).__name__}: {e}. Fix: copy it again from where the "
                             "checkpoint was saved.") from e
        return {k: path / f for k, f in weight_map.items()}
    keys: dict[str, Path] = {}
    for f in sorted(path.glob("*.safetensors")):
        with _open(f, listed=False) as sf:
            keys.update({k: f for k in sf.keys()})
    return keys


def _targets(pm) -> dict[str, list[str]]:
    """What must be filled: one entry per distinct tensor (tied weights once), all its names."""
    groups: dict[int, list[str]] = {}
    for name, p in pm.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(name)
    non_persistent = {f"{m}.{n}" if m else n for m, mod in pm.named_modules() for n in mod._non_persistent_buffers_set}
    for name, b in pm.named_buffers(remove_duplicate=False):
        if name not in non_persistent:
            groups.setdefault(id(b), []).append(name)
    return {names[0]: names for names in groups.values()}


def _find_prefix(names: list[str], keys) -> str:
    """The leading part of the model's names that checkpoint keys leave out: the one matching the most names."""
    keys = set(keys)
    counts: dict[str, int] = {}
    for n in names:
        parts = n.split(".")
        for i in range(len(parts)):
            if ".".join(parts[i:]) in keys:
                pre = ".".join(parts[:i]) + ("." if i else "")
                counts[pre] = counts.get(pre, 0) + 1
    if not counts:
        raise ValueError(f"no checkpoint key matches a name of the model (model: {names[:3]}..., checkpoint: "
                         f"{sorted(keys)[:3]}...). Fix: load the checkpoint of this model, or pass prefix=.")
    return max(counts, key=lambda p: (counts[p], -len(p)))


def _runs(index: torch.Tensor) -> list[tuple[int, int, int]]:
    """Contiguous runs of ascending global indices as (start, stop, local offset)."""
    if len(index) == 0:
        return []
    breaks = (torch.nonzero(index[1:] - index[:-1] != 1).flatten() + 1).tolist()
    bounds = [0] + breaks + [len(index)]
    return [(int(index[a]), int(index[b - 1]) + 1, a) for a, b in zip(bounds, bounds[1:])]


def _read_into(local: torch.Tensor, sl, index: list[torch.Tensor]) -> int:
    """Copy this rank's slice (global `index` per dim) of a safetensors tensor into `local`, one read per block;
    returns the bytes read."""
    import itertools
    per_dim = [_runs(i) for i in index]
    read = 0
    for blocks in itertools.product(*per_dim):
        src = sl[tuple(slice(a, b) for a, b, _ in blocks)] if blocks else sl[:]
        dst = local[tuple(slice(o, o + b - a) for a, b, o in blocks)] if blocks else local
        dst.copy_(src.reshape(dst.shape))
        read += src.numel() * src.element_size()
    return read


def _load_safetensors(pm, path: Path, prefix: str | None, strict: bool) -> set[str]:
    """Read this rank's slices; returns the names filled."""
    files = _safetensors_index(path)
    where, converted = _converted_keys(pm, files)
    targets = _targets(pm)
    all_names = [n for names in targets.values() for n in names]
    if prefix is None:
        prefix = _find_prefix(all_names, where)
    key_of: dict[str, str] = {}  # target -> checkpoint key
    missing = []
    for first, names in targets.items():
        found = [n[len(prefix):] for n in names if n.startswith(prefix) and n[len(prefix):] in where]
        if found:
            key_of[first] = found[0]
        else:
            missing.append(first)
    used = {k for first, names in targets.items() for n in names
            if n.startswith(prefix) and (k := n[len(prefix):]) in where}
    unexpected = sorted(set(where) - used)
    if missing or (strict and unexpected):
        raise ValueError(
            f"checkpoint {path} does not fit {type(pm).__name__} (prefix {prefix!r} stripped from the model's names): "
            f"missing {missing[:8]}{' ...' if len(missing) > 8 else ''} ({len(missing)}), unexpected "
            f"{unexpected[:8]}{' ...' if len(unexpected) > 8 else ''} ({len(unexpected)}). Fix: load the checkpoint "
            "saved from this model (save_pretrained of the same class and config), pass prefix= if the model's "
            "names carry another wrapper prefix, or strict=False to ignore extra checkpoint keys.")
    by_file: dict[Path, list[str]] = {}
    for first, key in key_of.items():
        if key not in converted:
            by_file.setdefault(where[key], []).append(first)
    listed = (path / "model.safetensors.index.json").exists()
    read: dict[str, int] = {}  # checkpoint key -> bytes this rank read of it
    with torch.no_grad():
        for file, firsts in sorted(by_file.items()):
            with _open(file, listed=listed) as sf:  # one file mapped at a time
                for first in firsts:
                    original = where.original(key_of[first])
                    read[original] = _fill(pm._lookup(first), sf.get_slice(original), original)
        with _OneOpen(listed, _hf_model(pm)) as opened:
            for first, key in key_of.items():
                if key in converted:
                    read.update(_fill_converted(pm._lookup(first), key, converted[key], files, opened))
    object.__setattr__(pm, "_bytes_read", read)
    return set(targets)


# ----------------------------------------------------------------------------- Hugging Face key conversions


class _Keys(dict):
    """Checkpoint key as the model names it (after `from_pretrained`'s renames) -> its file; `original(key)`: the
    key in the file."""

    def __init__(self, files: dict[str, Path], renamed: dict[str, str] | None = None):
        renamed = renamed or {k: k for k in files}
        super().__init__({new: files[old] for new, old in renamed.items()})
        self._old = renamed

    def original(self, key: str) -> str:
        return self._old[key]


def _hf_model(pm):
    """The outermost Hugging Face `PreTrainedModel` of the model `pm` was built from, or None."""
    model = pm._source if pm._source is not None else pm._model
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return None
    return next((m for m in model.modules() if isinstance(m, PreTrainedModel)), None)


def _converted_keys(pm, files: dict[str, Path]):
    """The checkpoint's keys renamed as `from_pretrained` of the model's Hugging Face class renames them in the
    installed transformers (`transformers.conversion_mapping.get_model_conversion_mapping`: its `WeightRenaming`s,
    then at most one `WeightConverter` per key, by `core_model_loading.rename_source_key`). Returns (`_Keys` of
    the renamed keys, {target key: (converter, {source pattern: its checkpoint keys in natural order})}) for the
    targets a converter assembles from several tensors (Mixtral's per-expert `w1`/`w3` -> `gate_up_proj`)."""
    hf = _hf_model(pm)
    if hf is None:
        return _Keys(files), {}
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, dot_natural_key, rename_source_key
    transforms = get_model_conversion_mapping(hf)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    if not renamings and not converters:
        return _Keys(files), {}
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    renamed: dict[str, str] = {}
    converted: dict[str, tuple] = {}
    for key in sorted(files, key=dot_natural_key):
        new, pattern = rename_source_key(key, renamings, converters)
        if pattern is None:
            renamed[new] = key
        else:
            converted.setdefault(new, (by_pattern[pattern], {}))[1].setdefault(pattern, []).append(key)
    # a one-to-many converter (Dinov2's SwiGLU `weights_in` -> `gate_proj`, `up_proj`: `Chunk`, `Split`) names its
    # first target; its other targets are the same key with the first target pattern replaced, as transformers'
    # `WeightConverter.convert` names them
    for first in list(converted):
        conv, sources = converted[first]
        converted[first] = (conv, sources, first)
        head = conv.target_patterns[0]
        if len(conv.target_patterns) > 1 and head in first:
            prefix, _, suffix = first.partition(head)
            for other in conv.target_patterns[1:]:
                converted[prefix + other + suffix] = (conv, sources, first)
    keys = _Keys(files, renamed)
    for new, (conv, sources, _) in converted.items():
        keys[new] = files[next(iter(sources.values()))[0]]
    return keys, converted


def _fill_converted(target, key: str, conversion, files: dict[str, Path], opened: _OneOpen) -> dict[str, int]:
    """Fill `target` (the model's tensor `key`) from the checkpoint tensors a `WeightConverter` assembles it from;
    returns the bytes read per checkpoint key. Stacking (`MergeModulelist`) then concatenating (`Concatenate`), the
    converters of MoE experts: each source tensor's block of the target is known, so this rank reads only the
    parts of the blocks its shard holds (an expert it does not own: nothing). Any other operations: the sources
    are read whole and converted by transformers' own operations, then this rank's shard is taken."""
    conv, sources, layer = conversion
    kinds = [type(op).__name__ for op in conv.operations]
    local = target.to_local() if isinstance(target, DTensor) else target
    if isinstance(target, DTensor):
        index = local_indices(tuple(target.shape), target.device_mesh, target.placements)
    else:
        index = [torch.arange(n) for n in target.shape]
    if local.numel() == 0:
        return {k: 0 for keys in sources.values() for k in keys}
    patterns = [p for p in conv.source_patterns if p in sources]
    if kinds not in (["MergeModulelist"], ["MergeModulelist", "Concatenate"]) or len(conv.target_patterns) > 1:
        return _fill_by_transformers(local, index, tuple(target.shape), key, layer, conv, {p: sources[p] for p in patterns}, files, opened)
    stack = conv.operations[0].dim
    cat = conv.operations[1].dim if len(kinds) == 2 else None
    read: dict[str, int] = {}
    offset = 0
    for p in patterns:
        keys = sources[p]
        if len(keys) != target.shape[stack]:
            raise ValueError(f"autopar.load{_on_rank()}: {key} {tuple(target.shape)} is stacked on dim {stack} from "
                             f"{len(keys)} checkpoint tensors ({keys[0]}, ...), not {target.shape[stack]}. Fix: load "
                             "the checkpoint of a model with the same config")
        size = None
        for i, k in enumerate(keys):
            sl = opened.get(files[k]).get_slice(k)
            shape = tuple(sl.get_shape())
            size = shape[cat - 1 if cat > stack else cat] if cat is not None else None
            read[k] = _read_block(local, index, sl, stack, i, cat, offset, shape, key, k, tuple(target.shape))
        offset += size or 0
    if cat is not None and offset != target.shape[cat]:
        raise ValueError(f"autopar.load{_on_rank()}: {key} {tuple(target.shape)} is concatenated on dim {cat} from "
                         f"checkpoint tensors of {offset} there. Fix: load the checkpoint of a model with this config")
    return read


def _read_block(local, index, sl, stack: int, i: int, cat: int | None, offset: int, shape, key: str, k: str,
                full_shape) -> int:
    """Read the part of source tensor `k` (item `i` stacked on dim `stack`, at `offset` on dim `cat`) that this
    rank's shard (global `index` per dim) holds into `local`; the bytes read."""
    pos = (index[stack] == i).nonzero().flatten()
    if len(pos) == 0:
        return 0  # an expert this rank does not hold
    src_index, dst_pos = [], []
    for t in range(len(index)):
        if t == stack:
            continue
        n = shape[t - 1 if t > stack else t]
        lo = offset if t == cat else 0
        if t != cat and n != full_shape[t]:
            raise ValueError(f"autopar.load{_on_rank()}: checkpoint tensor {k} has shape {shape}, which does not fit "
                             f"{key} {full_shape}. Fix: load the checkpoint of a model with the same config")
        mask = (index[t] >= lo) & (index[t] < lo + n)
        if not mask.any():
            return 0
        src_index.append(index[t][mask] - lo)
        dst_pos.append(mask.nonzero().flatten())
    block = torch.empty([len(s) for s in src_index], dtype=local.dtype)
    read = _read_into(block, sl, src_index)
    dst = local.select(stack, int(pos[0]))
    dst.index_put_(torch.meshgrid(*dst_pos, indexing="ij"), block.to(dst.device))
    return read


def _fill_by_transformers(local, index, shape, key, layer, conv, sources: dict[str, list[str]], files,
                          opened) -> dict[str, int]:
    """A converter autopar does not slice: its sources read whole, converted by transformers' operations (with the
    model and config some need: `Split` sizes its pieces by the model's parameters), then this rank's shard of the
    target `key` taken. `layer` is the converter's first target key: a one-to-many converter's outputs are keyed by
    target pattern, and its siblings' fills reuse the conversion (`opened.converted`, held until all are filled):
    the sources are read once."""
    read: dict[str, int] = {}
    if layer not in opened.converted:
        collected: dict[str, list[torch.Tensor]] = {}
        for p, keys in sources.items():
            for k in keys:
                t = opened.get(files[k]).get_tensor(k)
                read[k] = t.numel() * t.element_size()
                collected.setdefault(p, []).append(t)
        for op in conv.operations:
            collected = op.convert(collected, source_patterns=list(conv.source_patterns),
                                   target_patterns=list(conv.target_patterns), full_layer_name=layer,
                                   model=opened.hf, config=getattr(opened.hf, "config", None), missing_keys=None)
        opened.converted[layer] = [collected, len(conv.target_patterns)]
    held = opened.converted[layer]
    collected = held[0]
    held[1] -= 1
    if held[1] <= 0:  # every target of this conversion filled: let its tensors go
        del opened.converted[layer]
    if len(collected) == 1:
        (full,) = collected.values()
    else:
        prefix, _, suffix = layer.partition(conv.target_patterns[0])
        full = next((v for p, v in collected.items() if prefix + p + suffix == key), None)
        if full is None:
            raise ValueError(f"autopar.load{_on_rank()}: transformers' {type(conv).__name__} of {layer} gave "
                             f"{sorted(collected)}, none of which is {key}. Fix: load with the transformers version the "
                             "checkpoint was saved with, or report this model class")
    full = full[0] if isinstance(full, list) else full
    if tuple(full.shape) != shape:
        raise ValueError(f"autopar.load{_on_rank()}: {key} converted from the checkpoint has shape "
                         f"{tuple(full.shape)}, the model's is {shape}. Fix: load the checkpoint of a model with the "
                         "same config")
    local.copy_(full[torch.meshgrid(*index, indexing="ij")])
    return read


def _fill(target, sl, key: str) -> int:
    shape = tuple(sl.get_shape())
    if tuple(target.shape) != shape:
        raise ValueError(f"checkpoint tensor {key} has shape {shape}, the model's has {tuple(target.shape)}; "
                         "Fix: load the checkpoint of a model with the same config")
    if isinstance(target, DTensor):
        local = target.to_local()
        if local.numel() == 0:
            return 0  # an expert this rank does not own
        # an owned expert is a replicated DTensor on its owners' sub-mesh: read whole there
        return _read_into(local, sl, local_indices(shape, target.device_mesh, target.placements))
    return _read_into(target, sl, [torch.arange(n) for n in shape])


# ----------------------------------------------------------------------------- init


_INIT_METHODS = ("reset_parameters", "init_weights", "_init_weights")


def _shard_seed(seed: int, name: str, t) -> int:
    """Equal for the ranks that hold the same shard of `name`, different for different shards."""
    if isinstance(t, DTensor):
        coords = [t.device_mesh.get_local_rank(ax) if not p.is_replicate() else -1
                  for ax, p in enumerate(t.placements)]
    else:
        coords = []
    digest = hashlib.sha256(f"{seed}|{name}|{coords}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


@torch.no_grad()
def init_weights(pm, seed: int = 0) -> None:
    """Run the source model's initialisation on `pm`'s shards (see the module docstring)."""
    model = pm._source
    if model is None:
        raise ValueError("init_weights initialises a ParallelModule built from a meta-device model; this one was "
                         "built from real parameters, which it already holds. Fix: build the model under "
                         "torch.device('meta') to initialise it on the shards.")
    owners = _hf_owners(model)
    done: set[int] = set()
    for path, mod in model.named_modules():
        own = [(n, t) for n, t in [*mod._parameters.items(), *mod._buffers.items()]
               if t is not None and (n in mod._parameters or n not in mod._non_persistent_buffers_set)]
        if not own:
            continue
        owner = owners.get(id(mod))
        fn = (lambda m, o=owner: o._init_weights(m)) if owner is not None else _own_init(mod)
        for n, t in own:
            name = f"{path}.{n}" if path else n
            value = pm._lookup(name)
            if id(value) in done:
                continue  # a tied weight: initialised once, by the first module that holds it
            if fn is None:
                raise NotImplementedError(
                    f"{name}: {type(mod).__name__} has no initialisation autopar can run ({' / '.join(_INIT_METHODS)}, "
                    "or a Hugging Face _init_weights). Fix: load a checkpoint with autopar.load, or give "
                    f"{type(mod).__name__} a reset_parameters() method.")
            others_p = {k: torch.empty_like(v, device="meta") for k, v in mod._parameters.items() if v is not None}
            others_b = {k: torch.empty_like(v, device="meta") for k, v in mod._buffers.items() if v is not None}
            (others_p if n in mod._parameters else others_b)[n] = value
            standin = _standin(mod, others_p, others_b)
            local = value.to_local() if isinstance(value, DTensor) else value
            if local.is_floating_point():
                local.fill_(float("nan"))  # to see what the initialisation did not write
            device = local.device
            with torch.random.fork_rng(devices=[] if device.type == "cpu" else [device], device_type=device.type):
                torch.manual_seed(_shard_seed(seed, name, value))
                fn(standin)
            _fix_padding_row(standin, n, value)
            if local.is_floating_point() and local.isnan().any():
                how = "Hugging Face _init_weights" if owner is not None else "its own method"
                raise NotImplementedError(
                    f"{name}: the initialisation of {type(mod).__name__} ({how}) did not set it (entirely). Fix: "
                    "load a checkpoint with autopar.load, or make the module's initialisation cover this parameter.")
            done.add(id(value))
        pm._unfilled -= {f"{path}.{n}" if path else n for n, _ in own}
    pm._unfilled -= {names[0] for names in _targets(pm).values() if id(pm._lookup(names[0])) in done}
    if pm._unfilled:
        raise AssertionError(f"init_weights left {sorted(pm._unfilled)[:5]} uninitialised")


def _own_init(mod: nn.Module):
    for name in _INIT_METHODS:
        method = getattr(type(mod), name, None)
        if callable(method):
            return lambda m, name=name: getattr(m, name)()
    return None


def _fix_padding_row(mod: nn.Module, name: str, value) -> None:
    """An embedding's padding row is zero after its initialisation; on a row-sharded DTensor `weight[pad].zero_()`
    writes into a gathered copy, so it is zeroed here on the shard that holds it."""
    pad = getattr(mod, "padding_idx", None)
    if name != "weight" or pad is None or not isinstance(mod, nn.Embedding) or not isinstance(value, DTensor):
        return
    index = local_indices(value.shape, value.device_mesh, value.placements)[0]
    hit = (index == pad % value.shape[0]).nonzero().flatten()
    if len(hit):
        value.to_local()[int(hit[0])].zero_()
