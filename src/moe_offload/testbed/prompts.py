"""The prompts of a command that generates (``generate``, ``trace collect``, ``bench``): ``--prompt``, ``--prompts
FILE``, ``--sharegpt N`` (options added by ``cli.args.add_prompt_args``), else a few short ShareGPT turns."""

from __future__ import annotations

from pathlib import Path

from ..errors import MoeOffloadError
from .sharegpt import human_turns

#: prompts of a command given none: the first this many short ShareGPT human turns
DEFAULT_PROMPTS = 3


def load_prompts(args) -> list[str]:
    """Prompts from ``--prompt``, ``--prompts FILE`` or ``--sharegpt N``; default: a few short ShareGPT turns."""
    prompts: list[str] = list(args.prompt or [])
    if args.prompts:
        try:
            lines = Path(args.prompts).read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as e:
            raise MoeOffloadError(f"cannot read prompts file {args.prompts}: {e.__class__.__name__}: "
                                  f"{getattr(e, 'strerror', None) or e}") from None
        prompts += [ln for ln in lines if ln.strip()]
        if not prompts:
            raise MoeOffloadError(f"prompts file {args.prompts} holds no prompt")
    if args.sharegpt:
        prompts += human_turns(args.sharegpt, offset=args.sharegpt_offset)
    if not prompts:
        prompts = [t for t in human_turns(50) if len(t) <= 300][:DEFAULT_PROMPTS]
    return prompts
