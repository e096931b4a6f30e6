"""``moe-offload bench disk`` (issue 36): the disk regime side by side with llama.cpp, in one run, one table.

Each *cell* is one engine configuration (a row) under one memory limit (a column group), run as its own process in
a child memory cgroup (``runtime.host_memory.ChildCgroup``; page cache counted, as the kernel does) whose limit is
that engine's measured baseline plus a share of the expert bytes:

- rows: our FullLoad (every weight in memory, unlimited: the reference for tokens and for "vs own unlimited"),
  our disk store (``--host-store disk``) with each ``--policy`` asked for, our ``--host-store mmap`` (half of the
  share in slots, the page cache for the rest), and llama.cpp's ``llama-completion`` on the checkpoint's GGUF
  (default mmap; "not installed" without a binary);
- baselines, measured first in unlimited cgroups, one per engine configuration: ours (the disk store) = the peak of
  a disk-store run less its slot bytes (the interpreter, torch, the non-expert weights, the KV cache, the staging
  buffers, and the page cache of the non-expert weights it read at load: room it cannot fill with experts, kept as
  headroom for transients and for policies that hold more than the probe's lru, e.g. a predictor); our mmap mode's
  = the most an mmap run used beside the checkpoint's page cache (sampled, ``disk_measure.run_limited``) less its
  slot bytes: its own memory, because any page cache a limit leaves it becomes room for experts (with the disk
  store's baseline it held every expert of testbed-sparse beyond its share); llama.cpp's = the peak of
  its unlimited run less the expert bytes it left in the page cache (``runtime.page_cache.resident_pages`` over the
  GGUF's ``*_exps`` tensors: it computes on the other weights where they are mapped, so their pages are its own);
- before every cell the checkpoint's files and the GGUF are dropped from the page cache (``posix_fadvise``);
- columns: the share of the expert bytes the engine held when its run ended (its slots plus the expert pages the
  kernel still cached, ``runtime.page_cache.resident_pages`` over the expert tensors of the checkpoint or the
  GGUF: how much of its limit a page-cache engine turned into experts), decode tok/s (each engine's own decode timer), the fraction of the engine's own unlimited speed, hit rate
  (ours), MB read from disk per generated token (``wait4``'s ``ru_inblock`` of the engine's process: the same
  counter for both engines, load and prefill included), the achieved read GB/s (those bytes over the run's wall
  time), the row's physical limit min(FullLoad tok/s, disk GB/s / MB per token) with the disk's best measured
  bandwidth at the expert's size (``bench link --disk``), and whether our tokens equal FullLoad's;
- cells interleaved (each limit runs every row before the next limit), ``--reverse`` runs rows and limits in the
  opposite order: two runs in opposite orders keep the machine's drift from favouring one engine.

Units: bytes, seconds, GB/s = 1e9 bytes per second, MB = 1e6 bytes.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass, field
from functools import cached_property
from pathlib import Path

from ..core.policy_spec import PolicySpec, parse_policy
from ..errors import MoeOffloadError
from .disk_measure import (checkpoint_expert_ranges, expert_bytes_of_checkpoint, gguf_expert_ranges, measured,
                           parse_llama_decode, resident_in_ranges)

#: shares of the expert bytes in memory, each limit = baseline + share x expert bytes (1.0: all of them)
DEFAULT_FRACTIONS = (1.0, 0.45, 0.25, 0.10)
DEFAULT_POLICIES = tuple(parse_policy(p) for p in ("lru", "lfu", "auto", "xl", "seqmoe"))


@dataclass
class Cell:
    """One engine row under one memory limit (module docstring for the columns); ``status`` "ok", "oom" (killed
    by the cgroup's OOM killer), "failed: ..." or "not installed"."""

    row: str
    fraction: float | None
    limit_bytes: int | None
    status: str = "ok"
    decode_tok_s: float | None = None
    vs_own_unlimited: float | None = None
    hit_rate: float | None = None
    mb_read_per_token: float | None = None
    mb_read_per_token_at_least: float | None = None
    read_gbps: float | None = None
    physical_limit_tok_s: float | None = None
    tokens_equal_full_load: bool | None = None
    peak_bytes: int | None = None
    wall_s: float | None = None
    slot_bytes: int | None = None
    peak_beside_bytes: int | None = None
    cached_before_bytes: int | None = None
    page_cached_expert_bytes: int | None = None
    cpu_account: dict | None = None
    token_ids: list = field(default_factory=list, repr=False)


@dataclass
class DiskBench:
    """What one ``bench disk`` run compares (module docstring); built by ``cli/bench_disk.py``.

    Attributes:
        model_dir: our checkpoint; gguf: the same checkpoint as GGUF (None: no llama.cpp rows).
        llama_bin: llama.cpp's ``llama-completion`` (None: its rows say "not installed").
        prompt: the prompt text (chat template applied), the same for every engine.
        max_new_tokens: tokens generated per cell; threads: every engine's threads (ours ``--threads``, llama.cpp's ``-t``).
        policies: our disk-store rows (``core.policy_spec.PolicySpec``s; names are parsed); predictor: for the rows
            a predictor drives.
        fractions: shares of the expert bytes in memory; reverse: rows and limits in the opposite order.
        timeout_s: per cell; peers: False leaves out the mmap and llama.cpp rows; headroom_bytes: added to every
            limit (0: the limits as defined; tests give tiny checkpoints room for the run-to-run spread of a
            process's own peak, which there is larger than the share of their experts); llama_prompt: ``prompt`` in the chat template, as llama.cpp is given it (ours applies
            the template itself).
    """

    model_dir: Path
    gguf: Path | None
    llama_bin: Path | None
    prompt: str
    max_new_tokens: int = 128
    threads: int = 2
    policies: tuple = DEFAULT_POLICIES
    predictor: str | None = None
    fractions: tuple = DEFAULT_FRACTIONS
    reverse: bool = False
    timeout_s: float = 1800.0
    llama_prompt: str | None = None
    peers: bool = True
    headroom_bytes: int = 0
    @cached_property
    def expert_ranges(self) -> dict[Path, list[tuple[int, int]]]:
        """``{file: [(offset, nbytes)]}`` of the expert tensors of the checkpoint and the GGUF (read from their
        headers once): what each cell finds of them in the page cache when it ends."""
        out = checkpoint_expert_ranges(self.model_dir)
        if self.gguf is not None:
            out[self.gguf] = gguf_expert_ranges(self.gguf)
        return out

    def files(self) -> list[Path]:
        out = sorted(self.model_dir.glob("*.safetensors"))
        return out + ([self.gguf] if self.gguf is not None else [])

    def ours(self, store: str | None, residency: float = 1.0, policy: PolicySpec | str = "lru") -> list[str]:
        """Our ``generate --json`` command: FullLoad (``store`` None) or offloaded."""
        cmd = [sys.executable, "-m", "moe_offload.cli", "generate", "--model", str(self.model_dir), "--prompt",
               self.prompt, "--max-new-tokens", str(self.max_new_tokens), "--json", "--quiet", "--threads",
               str(self.threads)]
        if store is None:
            return cmd + ["--full-load"]
        spec = parse_policy(policy)
        cmd += ["--host-store", store, "--residency", f"{residency:.4f}", "--policy", spec.name]
        return cmd + (["--predictor", self.predictor] if spec.needs_predictor and self.predictor else [])

    def llama(self) -> list[str]:
        """llama.cpp's greedy completion of the same prompt (``llama_command``)."""
        return llama_command(self.llama_bin, self.gguf, self.llama_prompt or self.prompt, self.max_new_tokens,
                             self.threads)


def _measured_cell(bench: DiskBench, row: str, fraction, limit, cmd, ok, beside=None) -> tuple[Cell, dict]:
    """Run ``cmd`` (``disk_measure.measured``, ``beside`` passed on) into a ``Cell``; its ``status`` says a timeout,
    an OOM kill or a failure (a signal, or the last line of stderr when ``ok(r)`` is false), else stays "ok"."""
    r = measured(cmd, limit, bench.timeout_s, bench.files(), beside)
    cached = sum(resident_in_ranges(f, rs) for f, rs in bench.expert_ranges.items())  # the others were dropped
    cell = Cell(row, fraction, limit, peak_bytes=r["peak_bytes"], wall_s=r["wall_s"],
                cached_before_bytes=r["cached_before_bytes"], peak_beside_bytes=r["peak_beside_bytes"],
                page_cached_expert_bytes=cached)
    lines = r["stderr"].strip().splitlines()
    if r["timed_out"]:
        cell.status = f"timeout: not done in {bench.timeout_s:.0f} s"
        # it made fewer than max_new_tokens tokens, so its reads over that many are a lower bound per token
        cell.mb_read_per_token_at_least = r["read_bytes"] / bench.max_new_tokens / 1e6
    elif r["oom"]:
        cell.status = "oom"
    elif r["rc"] < 0:
        cell.status = f"failed: signal {-r['rc']}"
    elif not ok(r):
        cell.status = f"failed: {lines[-1] if lines else r['rc']}"
    return cell, r


def _rates(cell: Cell, r: dict, tokens: int) -> None:
    cell.mb_read_per_token = r["read_bytes"] / max(1, tokens) / 1e6
    cell.read_gbps = r["read_bytes"] / r["wall_s"] / 1e9


def _ours_cell(bench: DiskBench, row: str, fraction, limit, cmd, beside=None) -> Cell:
    cell, r = _measured_cell(bench, row, fraction, limit, cmd, lambda r: r["rc"] == 0, beside)
    if cell.status != "ok":
        return cell
    d = json.loads(r["stdout"])
    st = d["stats"]
    cell.decode_tok_s = st["decode_tokens_per_s"]
    cell.hit_rate = st.get("hit_rate")
    cell.token_ids = d["outputs"][0]["token_ids"]
    cell.slot_bytes = st.get("peak_slot_bytes", 0)
    cell.cpu_account = st.get("cpu_account")
    _rates(cell, r, len(cell.token_ids))
    return cell


def _llama_cell(bench: DiskBench, fraction, limit) -> Cell:
    if bench.llama_bin is None or bench.gguf is None:
        return Cell("llama.cpp (mmap)", fraction, limit, status="not installed")
    cell, r = _measured_cell(bench, "llama.cpp (mmap)", fraction, limit, bench.llama(),
                             lambda r: parse_llama_decode(r["stderr"]) is not None)
    if cell.status != "ok":
        return cell
    cell.decode_tok_s, n = parse_llama_decode(r["stderr"])
    _rates(cell, r, n)
    return cell


def run_bench(bench: DiskBench, say=print) -> dict:
    """Baselines, the reference rows, then every (limit, row) cell in interleaved order; returns ``{"cells",
    "baselines", "expert_bytes", ...}`` (``Cell`` as dicts).

    Raises:
        MoeOffloadError: no child memory cgroup can be made here; our FullLoad or baseline run fails.
    """
    expert_bytes, n_experts = expert_bytes_of_checkpoint(bench.model_dir)
    say(f"{n_experts} experts, {expert_bytes / 1e9:.3f} GB; reference runs")
    full = _ours_cell(bench, "FullLoad (ours, in memory)", None, None, bench.ours(None))
    if full.status != "ok":
        raise MoeOffloadError(f"our FullLoad run failed: {full.status}")
    probe = _ours_cell(bench, "baseline probe", 0.1, None, bench.ours("disk", 0.1))
    if probe.status != "ok":
        raise MoeOffloadError(f"our baseline run failed: {probe.status}")
    base_ours = probe.peak_bytes - probe.slot_bytes
    base_mmap = None
    if bench.peers:
        shards = sorted(bench.model_dir.glob("*.safetensors"))
        mprobe = _ours_cell(bench, "mmap baseline probe", 0.1, None, bench.ours("mmap", 0.05), beside=shards)
        if mprobe.status == "ok":
            base_mmap = mprobe.peak_beside_bytes - mprobe.slot_bytes
    cells = [full]
    base_llama = gguf_experts = None
    if bench.peers and bench.llama_bin is not None and bench.gguf is not None:
        ranges = bench.expert_ranges[bench.gguf]
        gguf_experts = sum(n for _, n in ranges)
        unl = _llama_cell(bench, None, None)
        unl.row = "llama.cpp (mmap, unlimited)"
        if unl.status == "ok":
            base_llama = unl.peak_bytes - resident_in_ranges(bench.gguf, ranges)
        cells.append(unl)
    fractions = sorted(bench.fractions, reverse=not bench.reverse)
    rows = [f"disk {p}" for p in bench.policies] + (["mmap", "llama.cpp"] if bench.peers else [])
    rows = rows[::-1] if bench.reverse else rows
    for f in fractions:
        for row in rows:
            say(f"{row} at {f:.0%} of the expert bytes")
            if row == "llama.cpp":
                limit = None if base_llama is None else int(base_llama + f * gguf_experts + bench.headroom_bytes)
                cells.append(_llama_cell(bench, f, limit) if limit is not None else
                             Cell("llama.cpp (mmap)", f, None, status="not installed" if bench.llama_bin is None
                                  else "no baseline (its unlimited run failed)"))
                say(_cell_line(cells[-1]))
                continue
            store, policy, res = ("mmap", "lru", f / 2) if row == "mmap" else ("disk", row.split()[1], f)
            name = "mmap (ours, half the share in slots)" if row == "mmap" else f"disk {policy} (ours)"
            base = base_mmap if row == "mmap" else base_ours
            if base is None:
                cells.append(Cell(name, f, None, status="no baseline (its probe run failed)"))
                say(_cell_line(cells[-1]))
                continue
            limit = int(base + f * expert_bytes + bench.headroom_bytes)
            cells.append(_ours_cell(bench, name, f, limit, bench.ours(store, res, policy)))
            say(_cell_line(cells[-1]))
    _finish(cells, full, expert_bytes // max(1, n_experts))
    return {"cells": [asdict(c) for c in cells], "baselines": {"ours": base_ours, "ours mmap": base_mmap,
                                                                    "llama.cpp": base_llama},
            "expert_bytes": expert_bytes, "gguf_expert_bytes": gguf_experts, "max_new_tokens": bench.max_new_tokens,
            "reverse": bench.reverse}


def _cell_line(c: Cell) -> str:
    """One progress line: a cell's status, speed and reads."""
    if c.status != "ok":
        return f"  {c.status}" + (f" (read {c.mb_read_per_token_at_least:.1f} MB per token or more)"
                                  if c.mb_read_per_token_at_least is not None else "")
    return (f"  {c.decode_tok_s:.2f} tok/s, {c.mb_read_per_token:.1f} MB read per token"
            + (f", hit rate {c.hit_rate:.3f}" if c.hit_rate is not None else ""))


def _finish(cells: list[Cell], full: Cell, one_expert: int) -> None:
    """Fill the derived columns: vs own unlimited, the physical limit (the disk's best measured GB/s at reads of
    ``one_expert`` bytes), tokens == FullLoad."""
    from ..core.disk_link import disk_gbps, this_machine_disk

    disk = this_machine_disk()
    unl_llama = next((c.decode_tok_s for c in cells if c.row == "llama.cpp (mmap, unlimited)"), None)
    for c in cells:
        if c.status != "ok":
            continue
        own = unl_llama if c.row.startswith("llama.cpp") else full.decode_tok_s
        c.vs_own_unlimited = c.decode_tok_s / own if own else None
        if disk and c.mb_read_per_token:
            gbps = disk_gbps(disk, one_expert, None)
            c.physical_limit_tok_s = min(full.decode_tok_s, gbps * 1e3 / c.mb_read_per_token)
        if not c.row.startswith("llama.cpp"):
            c.tokens_equal_full_load = c.token_ids == full.token_ids


def llama_command(llama_bin: Path, gguf: Path, prompt: str, max_new_tokens: int, threads: int) -> list[str]:
    """llama.cpp's ``llama-completion`` argv for a greedy completion of ``prompt`` (the chat template already
    applied): ``max_new_tokens`` tokens on ``threads`` threads, default mmap, no warm-up, no conversation mode."""
    return [str(llama_bin), "-m", str(gguf), "-p", prompt, "-n", str(max_new_tokens), "--temp", "0", "-t",
            str(threads), "-c", "4096", "-no-cnv", "--no-warmup", "--seed", "0"]


def llama_paths(arg: str | None) -> tuple[Path | None, Path | None]:
    """``(llama-completion, convert_hf_to_gguf.py or None)`` from ``--llama-cpp`` (a binary or a llama.cpp folder).

    Raises:
        MoeOffloadError: the path does not hold llama-completion.
    """
    if arg is None:
        return None, None
    p = Path(arg)
    if p.is_file():
        root = next((q for q in p.parents if (q / "convert_hf_to_gguf.py").is_file()), None)
        return p, root / "convert_hf_to_gguf.py" if root else None
    for cand in (p / "llama-completion", p / "bin" / "llama-completion", p / "build" / "bin" / "llama-completion"):
        if cand.is_file():
            conv = p / "convert_hf_to_gguf.py"
            return cand, conv if conv.is_file() else None
    raise MoeOffloadError(f"--llama-cpp {arg}: no llama-completion there (nor in bin/ or build/bin/)")
