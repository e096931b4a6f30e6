"""``moe-offload pack``: a checkpoint's routed experts written as an aligned expert pack (``models.expert_pack``), which
``--host-store disk`` reads straight into the device slots."""

from __future__ import annotations

from pathlib import Path


def add_parser(sub) -> None:
    """Register ``moe-offload pack``."""
    p = sub.add_parser("pack", help="write a checkpoint's experts as an aligned expert pack (each expert 4 KiB-aligned, "
                       "laid out as its slot row) that --host-store disk reads without a staging copy")
    p.add_argument("model", help="the checkpoint to pack (required): a checkpoint directory, a built-in name "
                   "(testbed, testbed-sparse, testbed-sparse-wide, llada2-medium) or a Hugging Face Hub name "
                   "ORG/NAME[@REVISION], as --model of generate")
    p.add_argument("--out", metavar="DIR", help="the pack folder to write: new or empty (default: moe-offload-pack "
                   "inside the model folder, where --host-store disk finds it by itself)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")


def run(args) -> int:
    """Write the pack; print where and how large. Returns 0.

    Raises:
        MoeOffloadError: a model that cannot be loaded, or an ``--out`` that exists and is not an empty folder."""
    from ..models.expert_pack import DEFAULT_DIR, PACK_FILE
    from ..models.pack_writer import write_pack
    from ..testbed.resolve import resolve_model

    path = Path(resolve_model(args.model, progress=not args.quiet))
    out = Path(args.out) if args.out else path / DEFAULT_DIR
    meta = write_pack(path, out, progress=not args.quiet)
    size = (out / PACK_FILE).stat().st_size
    print(f"wrote {out}: {meta['num_experts']} experts, {size / 1e9:.2f} GB ({meta['stride']} B per expert, "
          f"4 KiB-aligned); --host-store disk reads it "
          + ("by itself (it lies beside the model)" if out.resolve() == (path / DEFAULT_DIR).resolve()
             else f"with --pack {out}"))
    return 0
