"""A Megatron-written checkpoint (`sources.megatron.find_megatron`) as a conversion source.

The model is the one `model.hf_path` describes (its config.json: the HF names, the export's
config), as the native backend builds it — megatron-core's GPTModel, whose parameters these
checkpoints hold. Before a tensor is read, the description is held against the checkpoint:
what its run recorded (`megatron_model.check_facts`: Megatron-LM's `args`, Megatron-Bridge's
`run_config.yaml`, NeMo's `model.yaml`), the vocabulary padding its embedding has, and every
stored tensor's name and shape; a checkpoint holding a tensor the description has no row for
is refused too (a feature the export would drop). The names tried for each parameter are the
local spec's and the Transformer Engine spec's (`native.checkpoint.aliases`), with or without
megatron-core's stacked layer axis; `_extra_state` entries, optimizer and RNG state are not
read. Reading is the shared checkpoint path (`readers.DistSource` / `TorchSource`): a row's
tensor (or its TP shards, gathered and merged) becomes its HF tensors by the bridge's mapping.
There is no manifest, so no stored checksums: every tensor is checksummed as it is read, and
the byte-copy engines (which verify against a manifest's checksums) are not used.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from megatron_bridge.backends.native import checkpoint as names
from megatron_bridge.backends.registry import backend_of
from megatron_bridge.bridge.layout import Layout
from megatron_bridge.bridge.loader import shard_for, table_for
from megatron_bridge.bridge.spec import BridgeSpec
from megatron_bridge.bridge.table import Resolved, resolve_megatron
from megatron_bridge.convert.formats.dist_ckpt import DistLocation
from megatron_bridge.convert.formats.dist_read import DistReader
from megatron_bridge.convert.formats.dtypes import DType
from megatron_bridge.convert.formats.pickle_guard import MEGATRON
from megatron_bridge.convert.formats.torch_zip import TensorRef
from megatron_bridge.convert.formats.torch_zip_read import MEGATRON_STANDINS, LazyTorchFile, scan_torch_file
from megatron_bridge.convert.placement.rank_files import RankFile, Target, all_targets
from megatron_bridge.convert.sources.megatron import RANK_FILE, MegatronDir, common_state, find_megatron
from megatron_bridge.convert.sources.megatron_describe import Described, describe_source, hf_rows, synthetic_manifest
from megatron_bridge.convert.sources.megatron_model import run_record
from megatron_bridge.convert.sources.readers import (
    CheckpointSource,
    DistSource,
    Source,
    TorchSource,
    open_checkpoint,
)
from megatron_bridge.errors import UserError

if TYPE_CHECKING:  # torch is imported where it is used
    import torch

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
_EXPERT = re.compile(r"\.experts\.local_experts\.(\d+)\.")
IGNORED_PREFIXES = ("optimizer.", "rng_state", "rerun_state_machine", "opt_param_scheduler")


def _without_mtp(keys: list[str], where: str) -> list[str]:
    """`keys` but megatron-core's multi-token-prediction layers' (`mtp.`), which are skipped
    with a note, as an HF source's MTP layers are: the bridge does not build them."""
    mtp = [k for k in keys if k.startswith("mtp.")]
    if mtp:
        print(
            f"note: {where}: skipping {len(mtp)} tensor(s) of its multi-token-prediction layers (mtp.*): "
            "the bridge does not build MTP layers",
            flush=True,
        )
    return [k for k in keys if not k.startswith("mtp.")]


def _adopt(src: CheckpointSource, d: Described, found: dict[str, tuple[tuple[int, ...], DType]]) -> None:
    """`src` reads the model `d` describes from megatron tensors `found` ({name: (global shape,
    dtype)}): its HF tensors and rows, the manifest the commands read, where config and tokenizer are."""
    tensors, rows = hf_rows(src.spec, src.layout.tp, found, src.where)
    src.man = synthetic_manifest(d)
    src.assets_dir = d.config_file.parent if d.config_file else d.md.data
    src.config_file = d.config_file
    src.use_rows(tensors, rows)


class MegatronDistSource(DistSource):
    """A torch_dist checkpoint Megatron-LM, NeMo or Megatron-Bridge wrote."""

    byte_paths = False

    def __init__(self, md: MegatronDir, hf_path: Any, default_divisor: int, dtype: DType | None, arg: str):
        Source.__init__(self, dtype)
        self.where, self.expected, self.md = f"src={md.given}", {}, md
        self.reader = DistReader(md.data, self.io, prefix=md.prefix)
        state = common_state(md, self.io)
        emb = self._key_of("embedding.word_embeddings.weight")
        rows = self.reader.size(emb)[0] if emb else 0
        path, hf = _hf_arg(hf_path)
        d = describe_source(md, state, path, default_divisor, rows, arg, hf=hf)
        self.spec, self.layout = d.spec, Layout(tp=d.layout.tp)
        self.parts: dict[str, list[DistLocation]] = {}  # one, or SwiGLU's two halves (pre-0.14 format)
        found: dict[str, tuple[tuple[int, ...], DType]] = {}
        want = backend_of(self.spec).expected(self.spec, self.spec.shapes(self.layout.tp).padded_vocab_size)
        bad, missing = [], []
        table = table_for(self.spec)
        for name, shape in want.items():
            row = resolve_megatron(table, name)
            if row is not None and not row.mapping.export:
                continue  # the tied output layer: the embedding's tensor (not stored again)
            parts = self._find(name)
            if parts is None:
                missing.append(name)
                continue
            whole = None if shape is None else (shape if len(parts) == 1 else (shape[0] // 2, *shape[1:]))
            for loc in parts:
                size = self.reader.size(loc.key)
                param = size[len(loc.axes) :]
                if size[: len(loc.axes)] != loc.axes or (whole is not None and param != whole):
                    bad.append(f"{loc.key}: stored {list(size)}, {arg} implies {list(loc.axes + (whole or param))}")
            if bad:
                continue
            self.parts[name] = parts
            param = self.reader.size(parts[0].key)[len(parts[0].axes) :]
            found[name] = ((param[0] * len(parts), *param[1:]), self.reader.dtype(parts[0].key))
        if missing:
            raise UserError(
                f"{self.where} lacks {len(missing)} tensor(s) the model {arg} describes has, e.g. "
                f"{', '.join(missing[:4])}: another model's config, or a layer spec whose names are not known here"
            )
        if bad:
            raise UserError(
                f"{self.where} holds tensors of other shapes than the model {arg} describes:\n"
                + "\n".join(f"  - {b}" for b in bad[:8])
            )
        self._refuse_unknown()
        _adopt(self, d, found)

    def _key_of(self, name: str) -> str | None:
        keys = {name, *names.aliases(name)}
        return next((k for k in keys if self.reader.is_tensor(k)), None)

    def _find(self, name: str) -> list[DistLocation] | None:
        """Where parameter `name` is stored: the native location, under the local or TE spec's
        name, with megatron-core's stacked layer axis or one key per layer, and as megatron-core
        before 0.14 wrote it (`singleton_local_shards`: a key per expert, SwiGLU's fc1 as two
        halves `..._w` / `..._v`)."""
        loc = backend_of(self.spec).dist_location(self.spec, name)
        m = _LAYER.match(name)
        layer = int(m.group(1)) if m else None
        variants = [loc]
        if layer is not None and loc.key.startswith("decoder.layers.") and loc.offsets[:1] == (layer,) and loc.axes:
            rest = loc.key[len("decoder.layers.") :]
            variants.append(DistLocation(f"decoder.layers.{layer}.{rest}", loc.offsets[1:], loc.axes[1:]))
        elif layer is not None:
            rest = loc.key[len(f"decoder.layers.{layer}.") :]
            variants.append(
                DistLocation(f"decoder.layers.{rest}", (layer, *loc.offsets), (self.spec.num_layers, *loc.axes))
            )
        e = _EXPERT.search(name)
        if e:  # a key per expert: no expert axis
            expert = int(e.group(1))
            variants += [
                DistLocation(
                    v.key.replace(".experts.experts.", f".experts.experts.{expert}."), v.offsets[:-1], v.axes[:-1]
                )
                for v in list(variants)
            ]
        for v in variants:
            for key in (v.key, *names.aliases(v.key)):
                if self.reader.is_tensor(key):
                    return [DistLocation(key, v.offsets, v.axes)]
                if key.endswith("linear_fc1.weight") and all(self.reader.is_tensor(f"{key}_{h}") for h in "wv"):
                    return [DistLocation(f"{key}_{h}", v.offsets, v.axes) for h in "wv"]
        return None

    def _refuse_unknown(self) -> None:
        used = {loc.key for parts in self.parts.values() for loc in parts}
        extra = [
            k
            for k in self.reader.keys()
            if self.reader.is_tensor(k) and k not in used and not k.startswith(IGNORED_PREFIXES)
        ]
        extra = _without_mtp(extra, self.where)
        if extra:
            raise UserError(
                f"{self.where} holds {len(extra)} tensor(s) the model model.hf_path describes has no place for, "
                f"e.g. {', '.join(extra[:4])}: its config lacks a feature the checkpoint's model has (exporting "
                "would drop them); point model.hf_path at the config of the model this checkpoint trained"
            )

    def location(self, name: str) -> DistLocation:
        return self.parts[name][0]

    def whole_key(self, name: str) -> str | None:
        return self.parts[name][0].key if len(self.parts[name]) == 1 else None

    def merged(self, row: Resolved) -> list[torch.Tensor]:
        parts = self.parts[row.megatron]
        if len(parts) == 1:
            return super().merged(row)
        import torch

        g = torch.cat([self.reader.read(p) for p in parts], 0)  # SwiGLU's [gate; up]
        return list(row.mapping.merge([g], self.shapes))

    def ranges(self, row: Resolved) -> list[tuple[Path, int, int]]:
        return [r for p in self.parts[self.source_row(row).megatron] for r in self.reader.ranges(p)]


class MegatronTorchSource(TorchSource):
    """Megatron-LM's per-rank `torch` format: `mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt`."""

    byte_paths = False
    standins = MEGATRON_STANDINS

    def __init__(self, md: MegatronDir, hf_path: Any, default_divisor: int, dtype: DType | None, arg: str):
        Source.__init__(self, dtype)
        self.where, self.expected, self.md, self.root = f"src={md.given}", {}, md, md.data
        for _, dirname in md.ranks:  # every pickle names only what Megatron writes, before anything loads
            scan_torch_file(md.data / dirname / RANK_FILE, MEGATRON)
        state = common_state(md, self.io)
        record = run_record(md, state)
        layout = record.layout(None)
        self._check_ranks(layout)
        self.layout = layout
        self._files = OrderedDict()
        first = self.file(RankFile(0, 0, 0))
        emb = self._local(first, "model" if not layout.vpp else "model0", "embedding.word_embeddings.weight")
        rows = emb.shape[0] * layout.tp if emb is not None else 0
        path, hf = _hf_arg(hf_path)
        d = describe_source(md, state, path, default_divisor, rows, arg, hf=hf)
        self.spec, self.layout = d.spec, d.layout
        shapes = backend_of(self.spec).expected(self.spec, self.spec.shapes(self.layout.tp).padded_vocab_size)
        unknown = [n for n, s in shapes.items() if s is None]
        if unknown:
            raise UserError(f"{self.where}: per-rank checkpoints of {unknown[0]} are not read here; use torch_dist")
        hint = self._dtype_hint(first)
        if hint is None:
            raise UserError(f"{self.path_of(RankFile(0, 0, 0))} holds no model weights (model / model0)")
        _adopt(self, d, {n: (s, hint) for n, s in shapes.items() if s})
        self.targets = all_targets(self.spec, self.layout, [r for r in self.rows if r.mapping.export])
        self._check_stored()

    def _check_ranks(self, layout: Layout) -> None:
        want = {(tp, pp, ep) for tp in range(layout.tp) for pp in range(layout.pp) for ep in range(layout.ep)}
        have = {self._coords(dirname, layout) for _, dirname in self.md.ranks}
        if want != have:
            raise UserError(
                f"{self.md.data}: its rank directories ({len(have)}) are not those of the layout its run "
                f"recorded (tp{layout.tp}·pp{layout.pp}·ep{layout.ep}: {len(want)}): an incomplete copy, or "
                "directories from two runs"
            )

    @staticmethod
    def _coords(dirname: str, layout: Layout) -> tuple[int, int, int]:
        parts = [int(p) for p in dirname[len("mp_rank_") :].split("_")]
        tp = parts[0]
        pp = parts[1] if layout.pp > 1 else 0
        ep = parts[-1] if layout.ep > 1 and len(parts) > 1 else 0
        return tp, pp, ep

    def path_of(self, f: RankFile) -> Path:
        name = f"mp_rank_{f.tp:02d}"
        if self.layout.pp > 1:
            name += f"_{f.pp:03d}"
        if self.layout.ep > 1:
            name += f"_{f.ep:03d}"
        return self.md.data / name / RANK_FILE

    @staticmethod
    def _local(f: LazyTorchFile, chunk: str, name: str) -> TensorRef | None:
        sd = f.obj.get(chunk) if isinstance(f.obj, dict) else None
        if not isinstance(sd, dict):
            return None
        for key in (name, *names.aliases(name)):
            if isinstance(sd.get(key), TensorRef):
                return sd[key]
        return None

    @staticmethod
    def _dtype_hint(f: LazyTorchFile) -> DType | None:
        sd = f.obj.get("model", f.obj.get("model0")) if isinstance(f.obj, dict) else None
        items = sd.items() if isinstance(sd, dict) else []
        refs = [v for k, v in items if isinstance(v, TensorRef) and not k.endswith("_extra_state")]  # TE 2: uint8
        return refs[0].dtype if refs else None

    def stored(self, f: LazyTorchFile, t: Target) -> TensorRef | None:
        return self._local(f, t.chunk, t.local)

    def _check_stored(self) -> None:
        """Every rank file holds each of its parameters in the shape the layout gives it, in
        the model's dtype, and nothing else but `_extra_state`s (legacy grouped-GEMM experts:
        refused naming them)."""
        shapes, bad = self.spec.shapes(self.layout.tp), []
        used: dict[RankFile, set[tuple[str, str]]] = {}
        by_row = {r.megatron: r for r in self.rows}
        for name, targets in self.targets.items():
            row = by_row[name]
            hf_shapes = row.select_shapes([self.tensors[h][0] for h in row.hf])
            for t in targets:
                ref = self.stored(self.file(t.file), t)
                if ref is None:
                    bad.append(f"{self.path_of(t.file)} has no {t.chunk}/{t.local}")
                    continue
                want = row.mapping.shard_shape(hf_shapes, shard_for(row, self.layout, t.coords), shapes)
                if tuple(ref.shape) != tuple(want):
                    bad.append(
                        f"{self.path_of(t.file)}: {t.local} is {list(ref.shape)}, the model's shard {list(want)}"
                    )
                for h in row.hf:  # the stored dtype (the first file's was a guess)
                    self.tensors[h] = (self.tensors[h][0], ref.dtype)
                used.setdefault(t.file, set()).add((t.chunk, t.local))
        if bad:
            raise UserError(
                f"{self.where} does not hold the model {self.man.source} as {self.layout.describe()} would:\n"
                + "\n".join(f"  - {b}" for b in bad[:8])
            )
        for f, keys in used.items():
            obj = self.file(f).obj
            for chunk in {c for c, _ in keys}:
                known = {k for c, n in keys if c == chunk for k in (n, *names.aliases(n))}
                extra = [
                    k
                    for k, v in obj[chunk].items()
                    if isinstance(v, TensorRef)
                    and k not in known
                    and not k.endswith("_extra_state")
                    and not (k == "output_layer.weight" and self.spec.tie_word_embeddings)  # the last stage's copy
                ]
                extra = _without_mtp(extra, str(self.path_of(f)))
                if extra:
                    legacy = [k for k in extra if k.endswith((".experts.weight1", ".experts.weight2"))]
                    hint = (
                        " (megatron-core's legacy GroupedMLP experts, --moe-grouped-gemm without Transformer "
                        "Engine: save the run with --ckpt-format torch_dist, which names each expert)"
                        if legacy
                        else ""
                    )
                    raise UserError(
                        f"{self.path_of(f)} holds tensors the model model.hf_path describes has no place for, "
                        f"e.g. {', '.join(extra[:4])}{hint}"
                    )


def _hf_arg(hf_path: Any) -> tuple[Any, dict[str, Any] | None]:
    return (None, hf_path) if isinstance(hf_path, dict) else (hf_path, None)


def open_megatron(
    md: MegatronDir, hf_path: Any, default_divisor: int, dtype: DType | None, arg: str = "model.hf_path"
) -> CheckpointSource:
    """`md`'s weights as a source of the model `hf_path` describes (see the module doc): an HF
    directory or config.json, or a parsed config.json (the run's model's)."""
    cls = MegatronDistSource if md.format == "torch_dist" else MegatronTorchSource
    return cls(md, hf_path, default_divisor, dtype, arg)


def open_for(path: Path, spec: BridgeSpec, dtype: DType | None, arg: str = "model.hf_path") -> CheckpointSource:
    """The checkpoint at `path` as the source of the model `spec` describes: an `mbr convert` /
    `mbr reshard` output (its manifest describes it), or a Megatron-written one, whose names
    come from `spec`'s HF config (`model.hf_path`, else the recipe's model as config.json)."""
    md = find_megatron(path)
    if md is None:
        return open_checkpoint(path, dtype)
    described_by = spec.source or backend_of(spec).hf_config(spec)
    return open_megatron(md, described_by, spec.make_vocab_size_divisible_by, dtype, arg)


__all__ = ["MegatronDistSource", "MegatronTorchSource", "open_for", "open_megatron"]
