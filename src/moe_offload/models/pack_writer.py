"""Writing an aligned expert pack (``moe-offload pack``; the format: ``models.expert_pack``): every routed expert read
as ``--host-store disk`` reads it and written at its place in the pack, ``pack.json`` last."""

from __future__ import annotations

import json
import os
from pathlib import Path

from ..errors import MoeOffloadError
from .expert_pack import FORMAT, META_FILE, PACK_FILE, checkpoint_fingerprint, layout_record, stride_for


def write_pack(model_dir: Path, out: Path, progress: bool = True) -> dict:
    """Write ``model_dir``'s routed experts into a new pack at ``out`` (module docstring). Each expert is read as
    ``--host-store disk`` reads it (direct I/O) into a page-aligned row and written at its offset; ``pack.json`` is
    written last. Returns the ``pack.json`` record.

    Raises:
        MoeOffloadError: ``out`` exists and is a file or a non-empty folder (nothing of it is touched), or the
            model cannot be loaded (``models.loader.load_offloaded``'s errors)."""
    from tqdm.auto import tqdm

    from ..runtime import huge_pages
    from .capability import top_k
    from .checkpoint import read_config
    from .loader import load_offloaded

    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise MoeOffloadError(f"{out} already exists and is not an empty folder: choose another --out "
                              "(nothing was written)")
    fingerprint = checkpoint_fingerprint(model_dir)
    _, config, _ = read_config(model_dir)
    # the fewest slots a model can run with: the pack is written from the disk store, not from the slots
    lm = load_offloaded(model_dir, device="cpu", slots=top_k(config), host_store="disk", pack=False,
                        progress=progress)
    try:
        store, total = lm.engine.store, lm.num_moe_layers * lm.num_experts
        n, stride = store.layout.expert_bytes, stride_for(store.layout.expert_bytes)
        created = not out.exists()
        out.mkdir(parents=True, exist_ok=True)
        row = huge_pages.io_buffer(stride).numpy()  # page-aligned, zero padding after the row
        buf = memoryview(row)
        tmp = out / (PACK_FILE + ".partial")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            for eid in tqdm(range(total), desc="experts -> pack", unit="expert", disable=not progress, leave=False):
                store.copy_to(eid, row[:n])
                if os.pwrite(fd, buf, eid * stride) != stride:
                    raise MoeOffloadError(f"writing {tmp} failed: disk full?")
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # written: none of it need stay in the page cache
        except BaseException:  # an interrupted pack leaves nothing behind: no partial file, no folder it made
            tmp.unlink(missing_ok=True)
            if created:
                out.rmdir()
            raise
        finally:
            os.close(fd)
        os.replace(tmp, out / PACK_FILE)
        meta = {"format": FORMAT, "model": str(Path(model_dir).resolve()), "checkpoint": fingerprint,
                "layout": layout_record(store.layout), "num_experts": total, "stride": stride}
        (out / META_FILE).write_text(json.dumps(meta, indent=1) + "\n")
        return meta
    finally:
        lm.close()
