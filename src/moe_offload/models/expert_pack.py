"""The aligned expert pack (``moe-offload pack``; issue 47 part 2): every routed expert's bytes laid out exactly as
its device slot row, one expert after another in global expert order, each starting on a 4 KiB boundary, so that
``--host-store disk`` reads an expert with one direct read straight into its slot: no staging buffer, no copy
(``runtime.disk_store.DiskStore``, "in place").

A pack is a folder holding ``experts.pack`` (expert ``e`` at byte ``e * stride``, ``stride`` = the row's bytes
rounded up to ``IO_ALIGN``; the padding is zeros) and ``pack.json``: the format version, the expert layout it was
written for (fields, dtypes, offsets, ``expert_bytes``), the number of experts, and the checkpoint's fingerprint
(``checkpoint_fingerprint``: config.json's and every safetensors file's size, modification time and header hash).
``pack.json`` is written last, so a pack whose writing was interrupted is no pack.

``--host-store disk`` uses the pack given to it (``--pack DIR``) or the one lying beside the model
(``<model>/moe-offload-pack``, ``DEFAULT_DIR``); a pack that does not match the checkpoint or the layout the loader
builds is an error, never a silent fallback (its bytes would not be the model's).

Units: bytes.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from ..errors import MoeOffloadError

#: the pack folder ``--host-store disk`` looks for inside the model folder, and ``pack``'s default ``--out``
DEFAULT_DIR = "moe-offload-pack"
PACK_FILE = "experts.pack"
META_FILE = "pack.json"
FORMAT = 1
#: every expert starts on a multiple of this many bytes (direct I/O's alignment, ``runtime.direct_io.IO_ALIGN``)
PACK_ALIGN = 4096


def checkpoint_fingerprint(model_dir: Path) -> dict:
    """What identifies a checkpoint's bytes cheaply: config.json's SHA-256, and per safetensors file its size,
    modification time (ns) and its header's SHA-256 (the parsed header, read without read-ahead by
    ``models.checkpoint.read_header``, so no expert enters the page cache). Any write to a file after packing changes
    its time, so an edited checkpoint never reads a stale pack (a copied checkpoint must be packed again too).

    Raises:
        MoeOffloadError: a safetensors file whose header cannot be read."""
    from .checkpoint import read_header

    files = {}
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        st = f.stat()
        try:
            header = read_header(f)[1]
        except (OSError, ValueError) as e:
            raise MoeOffloadError(f"cannot read the header of {f}: {e}") from None
        digest = hashlib.sha256(json.dumps(header, sort_keys=True).encode()).hexdigest()
        files[f.name] = [st.st_size, st.st_mtime_ns, digest]
    config = hashlib.sha256((Path(model_dir) / "config.json").read_bytes()).hexdigest()
    return {"config.json": config, "safetensors": files}


def layout_record(layout) -> dict:
    """A ``runtime.store.ExpertLayout`` as ``pack.json`` records it (fields with shapes, dtypes, offsets)."""
    return {"expert_bytes": layout.expert_bytes,
            "fields": [[f.name, list(f.shape), str(f.dtype).replace("torch.", ""), f.offset] for f in layout.fields]}


def stride_for(expert_bytes: int) -> int:
    """Bytes from one expert to the next in a pack: ``expert_bytes`` rounded up to ``PACK_ALIGN``."""
    return -(-expert_bytes // PACK_ALIGN) * PACK_ALIGN


@dataclass
class ExpertPack:
    """A pack folder that ``find_pack`` found (``meta``: its ``pack.json``)."""

    folder: Path
    meta: dict

    @property
    def file(self) -> Path:
        return self.folder / PACK_FILE

    def check(self, model_dir: Path, layout, num_experts: int) -> None:
        """Refuse a pack that is not this checkpoint's, as the loader lays its experts out.

        Raises:
            MoeOffloadError: another format version, a checkpoint changed since packing (names the first file that
                differs), another expert layout or count, or a pack file of the wrong size."""
        m, where = self.meta, f"the expert pack {self.folder}"
        if m.get("format") != FORMAT:
            raise MoeOffloadError(f"{where} has format {m.get('format')!r}, this version reads {FORMAT}: run "
                                  f"`moe-offload pack {model_dir}` again")
        now, then = checkpoint_fingerprint(model_dir), m.get("checkpoint", {})
        if now != then:
            names = ["config.json"] if now["config.json"] != then.get("config.json") else []
            old = then.get("safetensors", {})
            names += sorted(n for n in set(now["safetensors"]) | set(old) if now["safetensors"].get(n) != old.get(n))
            raise MoeOffloadError(f"{where} no longer matches {model_dir} ({', '.join(names) or 'its files'} changed "
                                  "since packing): pack it again (`moe-offload pack`) or remove the pack")
        if m.get("layout") != layout_record(layout) or m.get("num_experts") != num_experts:
            raise MoeOffloadError(f"{where} holds another expert layout than this version builds for {model_dir}: "
                                  "pack it again")
        size = self.file.stat().st_size if self.file.is_file() else -1
        if size != num_experts * stride_for(layout.expert_bytes):
            raise MoeOffloadError(f"{self.file} has {size} bytes, not {num_experts} experts of "
                                  f"{stride_for(layout.expert_bytes)}: pack it again")

    def add_to(self, store, num_experts: int) -> None:
        """Give ``store`` (a ``runtime.disk_store.DiskStore``) every expert as one aligned range of the pack."""
        stride, n = stride_for(store.layout.expert_bytes), store.layout.expert_bytes
        for eid in range(num_experts):
            store.add_segment(eid, 0, self.file, eid * stride, n)
        store.pack = self.folder


def find_pack(model_dir: Path, given: str | Path | None) -> ExpertPack | None:
    """The pack ``given`` (``--pack DIR``), else ``<model_dir>/DEFAULT_DIR`` if it holds a ``pack.json``, else None.

    Raises:
        MoeOffloadError: ``given`` is not a pack folder, or a ``pack.json`` that cannot be read."""
    folder = Path(given) if given is not None else Path(model_dir) / DEFAULT_DIR
    meta = folder / META_FILE
    if not meta.is_file():
        if given is not None:
            raise MoeOffloadError(f"--pack {given}: no {META_FILE} there (make one with `moe-offload pack MODEL "
                                  "--out DIR`)")
        return None
    try:
        data = json.loads(meta.read_text())
    except (OSError, ValueError) as e:
        raise MoeOffloadError(f"cannot read {meta}: {e}") from None
    if not isinstance(data, dict):
        raise MoeOffloadError(f"{meta} is not a pack description")
    return ExpertPack(folder, data)
