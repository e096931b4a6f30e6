"""What the HTTP endpoints share (``serve.app``, ``serve.anthropic_api``): the loaded model, its worker (queued or
continuous batching), the memory plan and the server's settings, and what a request needs from them (prompt
encoding, generation settings, the stats body).
"""

from __future__ import annotations

import time

import torch

from ..common.seeds import seed_problem
from ..generation.generate import encode_prompt
from ..generation.report import tier_stats
from .jobs import Params, percentile
from .limits import DEFAULT_MAX_QUEUE, DEFAULT_MAX_REQUEST_BYTES
from .protocol import ChatCompletionRequest, CompletionRequest, OpenAIError
from .tool_formats import format_for, takes_tools, template_source
from .tool_output import ToolTurn
from .tool_requests import ToolRequest, openai_messages
from .worker import SCHEDULING, Worker


NO_SEED = -1  # ``seed: -1`` means no seed (llama.cpp's and many UIs' "random seed")


class ServeState:
    """Everything the endpoints need: the model, its worker, the memory plan and the server's settings.

    Args:
        lm: the loaded model (``models.loader.LoadedModel``, offloaded).
        model_name: the name clients pass as ``model``.
        max_context: most tokens (prompt + new) one request may use.
        plan: ``serve.memory.MemoryPlan`` of this model.
        diffusion: block-diffusion parameters (``block_length``, ``steps``, ``threshold``, ``prefix_cache``) or None.
        tracker: CPU memory tracker (``serve.memory_profile.DeviceTierTracker``) or None.
        batch_note: why the model runs batch 1, or None.
        cors_origins: the browser origins allowed to call the API (``create_app``; default ``("*",)``: any; empty:
            no CORS headers).
        max_queue: most requests waiting before new ones are refused as overloaded (None: no limit;
            ``serve.limits``).
        max_request_bytes: most bytes of a request body (``serve.limits.BodyLimit``).
        decoder: ``serve --graph``'s compiled decode step (``graph.decode.GraphDecoder``, batch 1), or None.
    """

    def __init__(self, lm, model_name: str, max_context: int, plan, diffusion: dict | None = None, tracker=None,
                 batch_note: str | None = None, cors_origins: tuple[str, ...] = ("*",),
                 max_queue: int | None = DEFAULT_MAX_QUEUE, max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
                 decoder=None):
        self.lm = lm
        self.max_queue = max_queue
        self.max_request_bytes = max_request_bytes
        self.cors_origins = tuple(cors_origins)
        self.model_name = model_name
        self.max_context = max_context
        self.plan = plan
        self.diffusion = diffusion
        self.tracker = tracker
        self.batch_note = batch_note
        max_batch = plan.batch if plan is not None else 1
        if max_batch > 1:
            from .batch_worker import BatchWorker

            self.worker = BatchWorker(lm, max_batch, tracker, prefill_tokens=max(1, max_context - 1))
        else:
            self.worker = Worker(lm, diffusion, tracker, decoder)
        self.created = int(time.time())
        if lm.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(lm.device)

    # -- memory ------------------------------------------------------------------------------------------------
    def memory(self) -> dict:
        """The plan, and the measured device-tier peak (bytes) with how it was measured."""
        from .memory import static_device_bytes

        lm = self.lm
        out = {"plan": self.plan.as_dict() if self.plan is not None else None}
        if lm.device.type == "cuda":
            peak, method = torch.cuda.max_memory_reserved(lm.device), "torch.cuda.max_memory_reserved"
            static, dynamic = None, None
        elif self.tracker is not None:
            static, dynamic = static_device_bytes(lm), self.tracker.peak_bytes
            peak, method = static + dynamic, ("parameters + buffers + slot pool + lookup table, plus the peak of "
                                              "tensor storages allocated during requests (DeviceTierTracker)")
        else:
            static, dynamic, peak, method = static_device_bytes(lm), None, None, "not measured (--track-memory)"
        budget = self.plan.budget_bytes if self.plan is not None else None
        out["measured"] = {"method": method, "device_peak_bytes": peak, "static_bytes": static,
                           "request_peak_bytes": dynamic,
                           "within_budget": (peak <= budget) if (peak is not None and budget is not None) else None}
        return out

    def stats(self) -> dict:
        """``GET /v1/stats``: engine counters (hits, misses, hit rate, bytes loaded), speed (decode tokens/s, TTFT),
        the slot pool (slots, residency, policy), requests (served, cancelled, failed, queue length) and memory."""
        lm, w = self.lm, self.worker
        s, eng = w.stats, lm.engine
        o = eng.stats
        total = lm.num_moe_layers * lm.num_experts
        ttft = list(s.ttft_s)
        server_ttft = list(s.server_ttft_s)
        out = {
            "model": self.model_name,
            "scheduling": getattr(w, "scheduling", SCHEDULING),
            "batch_size": getattr(w, "max_batch", 1),
            "batching": self.batching(),
            "policy": eng.policy_name,
            "device": str(lm.device),
            "dtype": str(lm.dtype).replace("torch.", ""),
            "max_context": self.max_context,
            "requests_served": s.requests_served,
            "requests_cancelled": s.requests_cancelled,
            "requests_failed": s.requests_failed,
            "requests_running": len(w.running_jobs()),
            "queue_length": w.queue_length,
            "prompt_tokens": s.prompt_tokens,
            "completion_tokens": s.completion_tokens,
            "decode_tokens": s.decode_tokens,
            "decode_s": s.decode_s,
            "decode_tokens_per_s": s.decode_tokens / s.decode_s if s.decode_s > 0 else 0.0,
            "ttft_s": sum(ttft) / len(ttft) if ttft else 0.0,
            "server_ttft_p50_s": percentile(server_ttft, 0.5),
            "server_ttft_p95_s": percentile(server_ttft, 0.95),
            "queue_wait_s_mean": sum(s.queue_s) / len(s.queue_s) if s.queue_s else 0.0,
            "hits": o.hits,
            "misses": o.misses,
            "hit_rate": o.hit_rate,
            "bytes_loaded": o.bytes_loaded,
            "load_time_s": o.load_time_s,
            "slots": eng.pool.num_slots,
            "routed_experts": total,
            "residency": eng.pool.num_slots / total,
            "expert_bytes": lm.expert_bytes,
            "host_store": lm.host_store,
            "memory": self.memory(),
        } | tier_stats(lm)
        if hasattr(o, "host_experts"):  # diffusion refresh planners (TIDE): host fallback and prefetch counters
            out |= {"host_fallback_experts": o.host_experts, "host_fallback_tokens": o.host_tokens,
                    "fallback_s": o.fallback_s, "prefetches": o.prefetches, "diffusion_steps": o.steps}
        if self.diffusion is not None:
            out["diffusion"] = dict(self.diffusion, streaming="block by block")
        graph = getattr(w, "graph_decoder", None)
        if graph is not None:  # serve --graph: the compiled step and how long it took to compile
            out["graph"] = {"backend": graph.backend, "compile_s": round(graph.compile_s, 3),
                            "static_cache_positions": graph.cache_len}
        return out

    def batching(self) -> dict:
        """``/v1/stats["batching"]``: the most sequences per decode step, why a model runs batch 1 (``note``), the
        live KV cache bytes, and per batch size: decode steps, tokens, distinct experts per MoE layer per step (mean)
        and the decode hit rate."""
        w = self.worker
        dec = getattr(w, "decoder", None)
        return {"max_batch": getattr(w, "max_batch", 1), "note": self.batch_note,
                "running": len(w.running_jobs()), "queue_length": w.queue_length,
                "kv_cache_bytes": dec.kv.nbytes() if dec is not None else None,
                "by_batch_size": dec.stats.as_dict() if dec is not None else {}}

    # -- request checks ----------------------------------------------------------------------------------------
    def check_model(self, name: str) -> None:
        """Raises OpenAIError (404, ``model_not_found``) unless ``name`` is the served model's name."""
        if name != self.model_name:
            raise OpenAIError(404, f"The model `{name}` does not exist; this server serves `{self.model_name}`.",
                              param="model", code="model_not_found")

    def params(self, req, prompt_tokens: int, max_tokens: int | None, max_tokens_param: str = "max_tokens") -> Params:
        """Validate the sampling settings and the token budget of a request (before it is queued): every integer
        field is range-checked here (``n``, ``seed`` by ``moe_offload.common.seeds``, ``max_tokens``) or where the prompt is
        encoded (token ids), so the worker never sees a value it cannot use.

        Raises:
            OpenAIError: 400 for an unsupported or out-of-range setting, or a prompt + max_tokens above the context.
        """
        if req.n not in (None, 1):
            raise OpenAIError(400, "only n = 1 is supported", param="n")
        seed = None if req.seed in (None, NO_SEED) else req.seed
        seed_bad = None if seed is None else seed_problem(seed)
        if seed_bad:
            raise OpenAIError(400, f"{seed_bad} (or -1: no seed)", param="seed")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(req, name) not in (None, 0, 0.0):
                raise OpenAIError(400, f"{name} is not supported", param=name)
        if req.logit_bias:
            raise OpenAIError(400, "logit_bias is not supported", param="logit_bias")
        temperature, top_p, top_k = self.sampling(req)
        stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        if len(stop) > 4 or any(not s for s in stop):
            raise OpenAIError(400, "stop must be at most 4 non-empty strings", param="stop")
        if prompt_tokens == 0:
            raise OpenAIError(400, "the prompt encodes to no token", param="prompt")
        room = self.max_context - prompt_tokens
        if max_tokens is None:
            if room <= 0:
                raise OpenAIError(400, f"This model's maximum context length is {self.max_context} tokens; the prompt "
                                  f"has {prompt_tokens}.", param="messages", code="context_length_exceeded")
            max_tokens = room
        if max_tokens <= 0:
            raise OpenAIError(400, f"{max_tokens_param} must be at least 1, got {max_tokens}", param=max_tokens_param)
        if max_tokens > room:
            raise OpenAIError(400, f"This model's maximum context length is {self.max_context} tokens. However, you "
                              f"requested {prompt_tokens + max_tokens} tokens ({prompt_tokens} in the prompt, "
                              f"{max_tokens} for the completion).", param=max_tokens_param,
                              code="context_length_exceeded")
        return Params(max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed, stop=stop, top_k=top_k)

    def check_tool_room(self, tools: ToolRequest, prompt_tokens: int) -> None:
        """Raises OpenAIError (400, ``context_length_exceeded``, param ``tools``) when a prompt with tools leaves no
        room in the context: the message says the tools' definitions take part of it."""
        if tools.active and prompt_tokens >= self.max_context:
            raise OpenAIError(400, f"This model's maximum context length is {self.max_context} tokens; the prompt "
                              f"with its {len(tools.tools)} tools' definitions has {prompt_tokens}.", param="tools",
                              code="context_length_exceeded")

    def sampling(self, req) -> tuple[float, float, int]:
        """``(temperature, top_p, top_k)`` of a request, range-checked, with null as the default (0, 1, off).

        The values go to the workers as sent: every worker (batch 1, continuous batching, block diffusion) samples
        with ``moe_offload.generation.sampling``, which defines every edge itself (a temperature below
        ``GREEDY_TEMPERATURE`` is greedy, ``top_p`` keeps at least the most probable token, ``top_k`` -1 / 0 / at
        least the vocabulary size is off and 1 is greedy).

        Raises:
            OpenAIError: 400 naming the field: temperature outside [0, 2], top_p outside [0, 1], top_k below -1.
        """
        temperature = 0.0 if req.temperature is None else float(req.temperature)
        if not 0 <= temperature <= 2:
            raise OpenAIError(400, f"temperature must be in [0, 2], got {temperature}", param="temperature")
        top_p = 1.0 if req.top_p is None else float(req.top_p)
        if not 0 <= top_p <= 1:
            raise OpenAIError(400, f"top_p must be in [0, 1], got {top_p}", param="top_p")
        top_k = 0 if req.top_k is None else req.top_k
        if top_k < -1:
            raise OpenAIError(400, f"top_k must be -1 or 0 (off) or a positive integer, got {top_k}", param="top_k")
        return temperature, top_p, top_k

    def chat_prompt(self, req: ChatCompletionRequest, tools: ToolRequest | None = None):
        """``(token ids, ToolTurn or None)`` of a chat request's messages and tools (``encode_chat``)."""
        return self.encode_chat(openai_messages(req.messages), tools)

    def encode_chat(self, msgs: list[dict], tools: ToolRequest | None = None, continue_final: bool = False):
        """``(token ids, turn)`` of a conversation with tools (``encode_messages``): the tools rendered by the chat
        template, and a forced call's opening (``tool_formats.ToolFormat.forced_opening``) appended, where
        generation starts; ``turn`` (``tool_output.ToolTurn``) parses the answer, None when the request's tools
        are not active (none, or ``tool_choice`` none: then neither rendered nor parsed).

        Raises:
            OpenAIError: 400 (``param`` ``tools``) when the model has no chat template or one that never reads
                ``tools``; the errors of ``encode_messages``.
        """
        if tools is None or not tools.active:
            return self.encode_messages(msgs, continue_final), None
        tok = self.lm.tokenizer
        source = template_source(tok, tools.tools)
        if not takes_tools(source):
            why = "has no chat template" if source is None else "has a chat template that never renders `tools`"
            raise OpenAIError(400, f"tools: this model {why}, so it cannot be told of tools", param="tools")
        fmt = format_for(tok, source)
        ids = self.encode_messages(msgs, continue_final, tools.tools)
        opening = fmt.forced_opening(tools.name) if tools.forced else ""
        if opening:
            ids = ids + tok.encode(opening, add_special_tokens=False)
        prefill = msgs[-1]["content"] if continue_final else ""
        prefix = tok.decode(ids) if fmt.whole_prompt else prefill + opening
        return ids, ToolTurn(tok, fmt, prefix, tools.tools)

    def encode_messages(self, msgs: list[dict], continue_final: bool = False,
                        tools: list[dict] | None = None) -> list[int]:
        """Token ids of ``[{"role", "content": str}]`` in the model's chat template (a single user message: its
        text, as ``generate`` encodes a prompt; several messages without a template: ``role: text`` lines).
        ``continue_final``: the last message is the assistant's start (prefill), which generation continues
        (transformers' ``continue_final_message``; without a template, its text after ``assistant:``). ``tools``:
        function tools the template renders (``apply_chat_template(tools=...)``; then always through the template).

        Raises:
            OpenAIError: 400 (``param`` ``messages``) for no message or one the chat template rejects.
        """
        if not msgs:
            raise OpenAIError(400, "messages must hold at least one message", param="messages")
        tok = self.lm.tokenizer
        if len(msgs) == 1 and msgs[0]["role"] == "user" and not tools:
            return encode_prompt(tok, msgs[0]["content"])
        if getattr(tok, "chat_template", None):
            try:
                ids = tok.apply_chat_template(msgs, tools=tools or None, add_generation_prompt=not continue_final,
                                              tokenize=True, continue_final_message=continue_final)
            except Exception as e:  # the template refused the conversation (e.g. roles out of order)
                raise OpenAIError(400, f"the chat template rejects these messages: {e}", param="messages") from None
            return list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        head = msgs[:-1] if continue_final else msgs
        text = "".join(f"{m['role']}: {m['content']}\n" for m in head) + "assistant:"
        if continue_final:
            text += " " + msgs[-1]["content"]
        return tok(text)["input_ids"]

    def completion_prompt(self, req: CompletionRequest) -> list[int]:
        """Token ids of a completions ``prompt`` (raw text, no chat template; or token ids as given)."""
        p = req.prompt
        if isinstance(p, list) and p and isinstance(p[0], str):
            if len(p) != 1:
                raise OpenAIError(400, "only one prompt per request is supported", param="prompt")
            p = p[0]
        if isinstance(p, str):
            return self.lm.tokenizer(p)["input_ids"]
        vocab = int(self.lm.model.config.vocab_size)
        if any(not 0 <= t < vocab for t in p):
            raise OpenAIError(400, f"prompt token ids must be in [0, {vocab})", param="prompt")
        return list(p)
