"""The static-cache decode loop: fixed-shape buffers, no host synchronisation inside a step,
one step captured as a CUDA graph and replayed (:class:`StaticCacheDecoder`), with
:class:`FlashSamplingHead` as the sampler (:class:`FlashSamplingDecoder`, :func:`generate`)."""

from __future__ import annotations

import contextlib
import inspect
import time
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn as nn
from torch import Tensor
from transformers import PretrainedConfig
from transformers.cache_utils import Cache, StaticCache, StaticLayer

from ...logprobs import parse_logprob_args
from ...noise import as_int64_tensor
from ...penalties import PenaltyState, penalties_on
from .attention import _GROUPED_DECODE_SDPA
from .head import FlashSamplingHead, Sampler, UnsupportedModelError, _prefix
from .projections import fuse_projections as _fuse_model_projections  # the keyword argument has the same name
from .prompts import _cache_kwarg, _default_pad_token_id, _num_new_tokens, _positions, _prepare_prompts, _stop_list

_MASK_KINDS = {"sdpa": "bool", "eager": "additive"}


@dataclass
class DecodeOutput:
    sequences: Tensor  # int64 [B, P + n]: the (left-padded) prompts followed by new_tokens
    new_tokens: Tensor  # int64 [B, n]: sampled tokens; pad_token_id after a row's stop token
    num_new_tokens: Tensor  # int64 [B]: tokens generated per row, its stop token included
    prompt_attention_mask: Tensor  # int64 [B, P]: 1 for prompt tokens, 0 for left padding
    decode_seconds: float | None = None  # wall time of the timed decode steps (return_timings)
    timed_steps: int = 0  # decode steps inside decode_seconds (graph replays when graphs are on)
    # With return_logprobs (NaN, -1 and 0 after a row's stop token):
    token_logprobs: Tensor | None = None  # float32 [B, n]: log-probability of each sampled token
    top_ids: Tensor | None = None  # int64 [B, n, N]: the N most probable tokens of each step (top_logprobs=N > 0)
    top_logprobs: Tensor | None = None  # float32 [B, n, N]: their log-probabilities, descending
    ranks: Tensor | None = None  # int64 [B, n]: 1-based rank of each sampled token (top_logprobs > 0)


@dataclass
class _Session:
    """Fixed-shape state of one decode configuration; a captured CUDA graph reads and
    writes exactly these tensors, so it can be replayed for any prompt of this shape."""

    key: tuple
    cache: Cache
    ids: Tensor  # [B, 1] token fed to the next step
    pos: Tensor  # [B, 1] its position id
    pad: Tensor  # [B] left padding per row
    kv_pos: Tensor  # [1] cache slot of the next step's token
    seed: Tensor
    offset: Tensor  # noise offset of the next sample
    step: Tensor  # [1] index of the next sample in `tokens`
    finished: Tensor  # [B] bool
    stop_ids: Tensor  # [S]
    pad_token: Tensor  # 0-d
    tokens: Tensor  # [B, L] sampled tokens
    slots: Tensor  # [L] arange
    token_logprobs: Tensor | None = None  # float32 [B, L], where the sampler returns logprobs
    top_ids: Tensor | None = None  # int64 [B, L, N], where N > 0
    top_logprobs: Tensor | None = None  # float32 [B, L, N]
    ranks: Tensor | None = None  # int64 [B, L]
    penalty_state: PenaltyState | None = None  # the rows' token history, where the sampler penalises
    used: bool = False
    graph: object = None
    graph_key: object = None
    graph_sampler: object = None  # keeps what the captured sampler reads (e.g. a temperature tensor) alive


def _round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


class StaticCacheDecoder:
    """Decode loop on a static KV cache with a pluggable sampler (the body of the model is
    the same for any sampler, which is what the benchmark compares).

    Args:
        model: a supported ``*ForCausalLM`` (see the package docstring), in eval mode.
        cuda_graph: on CUDA, capture one decode step as a CUDA graph (after two eager warm-up
            steps) and replay it; ignored on the CPU.
        check_every: with stop tokens, check every this many steps whether all rows have
            stopped (a host sync); the rows' outputs do not depend on it.
        cache_len_multiple: the cache length is ``P + max_new_tokens`` rounded up to this, so
            that calls with nearby lengths share the cache and the captured graph.
        compile_body: run the decode steps' model body through ``torch.compile`` (dynamic
            shapes, so one compilation serves every batch size; the prefill stays eager). It
            fuses the body's many small kernels, which otherwise dominate a small model's
            step even inside a CUDA graph. The first call pays the compilation.
        grouped_decode_attention: for a model loaded with ``attn_implementation="sdpa"`` and
            grouped-query attention, the decode steps attend with the query heads grouped per
            KV head instead of transformers' ``repeat_kv`` copy of the whole static cache in
            every layer (:func:`_grouped_decode_sdpa`; the same attention, less memory traffic
            that grows with B). The prefill and the model outside the decoder are unchanged.
            In a compiled body on CUDA it runs as two batched GEMMs and a float32 softmax
            (:func:`_grouped_decode_matmul_attention`), faster than the fused sdpa kernels'
            prefill-sized tiles for a one-token query.
        fuse_projections: call :func:`fuse_projections` on the model: each layer's q/k/v and
            gate/up projections run as one GEMM per group (what serving engines do with their
            weights). This changes the model in place: its parameters keep their objects, names
            and values, but their storage moves into the stacked weights (in-place updates reach
            the fused GEMMs). Outputs differ from the unfused model only by the GEMMs' summation
            order. Where the stack would be stale (a parameter replaced, converted, or given new
            storage) or while autograd records, the projections run one by one again
            (:meth:`_ProjectionGroup.fusable`). A captured CUDA graph reads the weights' memory
            as captured: update weights in place. Off by default because it edits the model.
    """

    warmup_steps = 2

    def __init__(self, model: nn.Module, *, cuda_graph: bool = True, check_every: int = 8,
                 cache_len_multiple: int = 64, compile_body: bool = False, grouped_decode_attention: bool = True,
                 fuse_projections: bool = False):
        self.model = model
        if fuse_projections:
            _fuse_model_projections(model)
        self.head = FlashSamplingHead(model)
        self.body = model.model
        self.step_body = torch.compile(self.body, dynamic=True) if compile_body else self.body
        self.config = model.config
        impl = getattr(self.config, "_attn_implementation", None)
        if impl not in _MASK_KINDS:
            raise UnsupportedModelError(
                f"{_prefix(model)} attn_implementation {impl!r} is not supported; load the model "
                "with attn_implementation='sdpa' or 'eager' (the decoder passes explicit 4-D masks)"
            )
        self.mask_kind = _MASK_KINDS[impl]
        # The configs whose attn implementation the decode steps switch (see _step_attention).
        self._step_configs = []
        if grouped_decode_attention and impl == "sdpa" and _GROUPED_DECODE_SDPA is not None:
            configs = {id(c): c for c in [self.config, *(getattr(m, "config", None) for m in self.body.modules())]
                       if isinstance(c, PretrainedConfig)}
            self._step_configs = [c for c in configs.values()
                                  if getattr(c, "_attn_implementation_internal", None) == "sdpa"]
        self.cuda_graph = cuda_graph
        self.check_every = max(1, int(check_every))
        self.cache_len_multiple = max(1, int(cache_len_multiple))
        self._pass_cache_position = "cache_position" in inspect.signature(self.body.forward).parameters
        self._cache_kwarg = _cache_kwarg(self.body.forward)
        self._session: _Session | None = None

    # ------------------------------------------------------------------ pieces of a step

    @property
    def device(self) -> torch.device:
        return self.head.weight.device

    @property
    def penalty_state(self) -> PenaltyState | None:
        """The current session's token history (``generate_with_sampler(penalty_history=True)``)."""
        return None if self._session is None else self._session.penalty_state

    def _dtype(self) -> torch.dtype:
        return next(self.body.parameters()).dtype

    def _mask(self, valid: Tensor) -> Tensor:
        """4-D attention mask [B, 1, Q, L] from a boolean `valid` for the model's attention."""
        if self.mask_kind == "bool":
            return valid
        dtype = self._dtype()
        zero = torch.zeros((), dtype=dtype, device=valid.device)
        return torch.where(valid, zero, torch.finfo(dtype).min)

    def _forward(self, s: _Session, ids: Tensor, pos: Tensor, valid: Tensor, cache_position: Tensor,
                 body: nn.Module | None = None) -> Tensor:
        kwargs = {"input_ids": ids, "attention_mask": self._mask(valid), "position_ids": pos,
                  self._cache_kwarg: s.cache, "use_cache": True}
        if self._pass_cache_position:  # transformers versions whose StaticCache writes at cache_position
            kwargs["cache_position"] = cache_position
        return (self.body if body is None else body)(**kwargs).last_hidden_state

    @staticmethod
    def _record(s: _Session, out) -> None:
        """Writes the step's sample (tokens, or the op's logprobs output) at ``s.step``; a
        finished row gets the pad token and NaN / -1 / 0 logprob entries."""
        tokens = out if isinstance(out, Tensor) else out.tokens
        tok = tokens.reshape(-1).to(torch.int64)
        tok = torch.where(s.finished, s.pad_token, tok)
        s.tokens.index_copy_(1, s.step, tok[:, None])
        if s.token_logprobs is not None:
            done = s.finished[:, None]
            s.token_logprobs.index_copy_(1, s.step, out.logprobs[:, :1].masked_fill(done, torch.nan))
            if s.top_ids is not None:
                s.top_ids.index_copy_(1, s.step, out.top_ids.masked_fill(done, -1)[:, None])
                s.top_logprobs.index_copy_(1, s.step, out.top_logprobs.masked_fill(done, torch.nan)[:, None])
                s.ranks.index_copy_(1, s.step, out.ranks[:, :1].masked_fill(done, 0))
        if s.stop_ids.numel():
            s.finished |= (tok[:, None] == s.stop_ids[None, :]).any(dim=1)
        s.ids.copy_(tok[:, None])
        s.offset.add_(1)
        s.step.add_(1)

    @contextlib.contextmanager
    def _step_attention(self):
        """Inside, the model's sdpa attention is :func:`_grouped_decode_sdpa` (the configs'
        implementation name is switched and restored; the name is read at every forward, and
        a compiled body guards on it)."""
        for c in self._step_configs:
            c._attn_implementation_internal = _GROUPED_DECODE_SDPA
        try:
            yield
        finally:
            for c in self._step_configs:
                c._attn_implementation_internal = "sdpa"

    def _step(self, s: _Session, sampler: Sampler) -> None:
        """One decode step: feed s.ids, sample the next token. No host sync."""
        valid = (s.slots[None, :] >= s.pad[:, None]) & (s.slots[None, :] <= s.kv_pos)
        with self._step_attention():
            hidden = self._forward(s, s.ids, s.pos, valid[:, None, None, :], s.kv_pos, body=self.step_body)
        tokens = sampler(hidden[:, -1], s.seed, s.offset)
        s.pos.add_(1)
        s.kv_pos.add_(1)
        self._record(s, tokens)

    # ------------------------------------------------------------------ setup

    def _new_cache(self, max_cache_len: int) -> Cache:
        cache = StaticCache(config=self.config, max_cache_len=max_cache_len)
        if not any(getattr(layer, "is_sliding", False) for layer in cache.layers):
            return cache
        window = getattr(self.config, "sliding_window", None)
        if window is None or max_cache_len > window:
            raise UnsupportedModelError(
                f"{_prefix(self.model)} sliding-window attention (window {window}) with a cache of "
                f"{max_cache_len} tokens is not supported; keep prompt + new tokens within the window"
            )
        # Within the window, sliding-window attention is full attention: plain static layers.
        return Cache(layers=[StaticLayer(max_cache_len=max_cache_len) for _ in cache.layers])

    def _session_for(self, batch: int, max_cache_len: int, n_stop: int, seed: Tensor, offset: Tensor,
                     logprobs: int | None = None) -> _Session:
        device = self.device
        key = (batch, max_cache_len, n_stop, tuple(seed.shape), tuple(offset.shape), device, logprobs)
        if self._session is not None and self._session.key == key:
            return self._session
        self._session = None  # frees the previous cache and graph first
        if device.type == "cuda":
            torch.cuda.empty_cache()
        i64 = dict(dtype=torch.int64, device=device)
        self._session = _Session(
            key=key,
            cache=self._new_cache(max_cache_len),
            ids=torch.zeros(batch, 1, **i64),
            pos=torch.zeros(batch, 1, **i64),
            pad=torch.zeros(batch, **i64),
            kv_pos=torch.zeros(1, **i64),
            seed=torch.zeros(seed.shape, **i64),
            offset=torch.zeros(offset.shape, **i64),
            step=torch.zeros(1, **i64),
            finished=torch.zeros(batch, dtype=torch.bool, device=device),
            stop_ids=torch.zeros(n_stop, **i64),
            pad_token=torch.zeros((), **i64),
            tokens=torch.zeros(batch, max_cache_len, **i64),
            slots=torch.arange(max_cache_len, device=device),
        )
        if logprobs is not None:
            f32 = dict(dtype=torch.float32, device=device)
            self._session.token_logprobs = torch.zeros(batch, max_cache_len, **f32)
            if logprobs > 0:
                self._session.top_ids = torch.zeros(batch, max_cache_len, logprobs, **i64)
                self._session.top_logprobs = torch.zeros(batch, max_cache_len, logprobs, **f32)
                self._session.ranks = torch.zeros(batch, max_cache_len, **i64)
        return self._session

    def _graphs_enabled(self) -> bool:
        return self.cuda_graph and self.device.type == "cuda"

    def _capture(self, s: _Session, sampler: Sampler) -> torch.cuda.CUDAGraph:
        """Runs warmup_steps real steps on a side stream, then captures one step."""
        stream = torch.cuda.Stream(device=self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(self.warmup_steps):
                self._step(s, sampler)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self._step(s, sampler)
        return graph

    # ------------------------------------------------------------------ decode

    @torch.no_grad()
    def generate_with_sampler(
        self,
        input_ids: Tensor | Sequence[Sequence[int]],
        attention_mask: Tensor | None = None,
        *,
        sampler: Sampler,
        sampler_key: object = None,
        max_new_tokens: int,
        seed: int | Tensor = 0,
        offset: int | Tensor = 0,
        stop_token_ids: Sequence[int] | Tensor | None = None,
        pad_token_id: int | None = None,
        max_cache_len: int | None = None,
        return_timings: bool = False,
        logprobs: int | None = None,
        penalty_history: bool = False,
    ) -> DecodeOutput:
        """Decodes ``max_new_tokens`` tokens per row with ``sampler(hidden, seed, offset)``
        choosing each token; ``sampler_key`` identifies the sampler for reusing a captured
        graph across calls (default: the sampler object itself). ``logprobs``: None where the
        sampler returns tokens; ``N >= 0`` where it returns the op's logprobs output of one
        sample per row with ``top_logprobs=N`` (a ``SampleOutput`` for ``N = 0``), recorded per
        step into fixed buffers (``DecodeOutput.token_logprobs``, and for ``N > 0`` ``top_ids``,
        ``top_logprobs``, ``ranks``). ``penalty_history``: the session keeps a
        :class:`flashsampling_cuda.PenaltyState` (``self.penalty_state`` while it decodes), loaded
        with the prompts here; the sampler reads it and counts its tokens into it (graph-safe: the
        state is refilled in place, so a captured step keeps reading the same tensors)."""
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        device = self.device
        stops = _stop_list(stop_token_ids)
        pad_id = _default_pad_token_id(self.model, pad_token_id, stops)
        ids, mask = _prepare_prompts(input_ids, attention_mask, pad_id, device)
        batch, prompt_len = ids.shape
        needed = prompt_len + max_new_tokens
        cache_len = _round_up(needed, self.cache_len_multiple) if max_cache_len is None else int(max_cache_len)
        if cache_len < needed:
            raise ValueError(
                f"max_cache_len={cache_len} < prompt length {prompt_len} + max_new_tokens {max_new_tokens}")
        seed_t = as_int64_tensor(seed, device)
        offset_t = as_int64_tensor(offset, device)
        s = self._session_for(batch, cache_len, len(stops), seed_t, offset_t, logprobs)
        if s.used:
            s.cache.reset()
        s.used = True
        pad = (mask == 0).sum(dim=1)
        s.pad.copy_(pad)
        s.seed.copy_(seed_t)
        s.offset.copy_(offset_t)
        s.step.zero_()
        s.finished.zero_()
        s.tokens.zero_()
        if stops:
            s.stop_ids.copy_(torch.tensor(stops, dtype=torch.int64))
        s.pad_token.fill_(pad_id)
        if penalty_history:
            if s.penalty_state is None:
                s.penalty_state = PenaltyState(batch=batch, capacity=cache_len, device=device)
            s.penalty_state.load_(torch.where(mask.bool(), ids, -1))

        # Prefill: the prompt's cache slots 0..P-1, the first token from its last position.
        q = torch.arange(prompt_len, device=device)
        valid = ((s.slots[None, None, :] >= pad[:, None, None]) & (s.slots[None, None, :] <= q[None, :, None])) | (
            s.slots[None, None, :] == q[None, :, None]
        )  # a padding query sees itself only: no fully masked rows
        positions = _positions(mask)
        hidden = self._forward(s, ids, positions, valid[:, None], q)
        tokens = sampler(hidden[:, -1].contiguous(), s.seed, s.offset)
        s.pos.copy_((prompt_len - pad)[:, None])
        s.kv_pos.fill_(prompt_len)
        self._record(s, tokens)

        use_graph = self._graphs_enabled()
        key = sampler if sampler_key is None else sampler_key
        steps = 1
        timed_steps, start, start_event, end_event = 0, None, None, None

        def check_stop() -> bool:
            return bool(stops) and steps % self.check_every == 0 and bool(s.finished.all())

        if use_graph and (s.graph is None or s.graph_key != key):
            s.graph = s.graph_key = s.graph_sampler = None
            if max_new_tokens - steps > self.warmup_steps:
                s.graph = self._capture(s, sampler)  # ran warmup_steps steps
                s.graph_key, s.graph_sampler = key, sampler
                steps += self.warmup_steps
        while steps < max_new_tokens:
            if timed_steps == 0 and start is None and start_event is None:
                if device.type == "cuda":
                    start_event = torch.cuda.Event(enable_timing=True)
                    end_event = torch.cuda.Event(enable_timing=True)
                    start_event.record()
                else:
                    start = time.perf_counter()
            if use_graph and s.graph is not None:
                s.graph.replay()
            else:
                self._step(s, sampler)
            steps += 1
            timed_steps += 1
            if check_stop():
                break
        decode_seconds = None
        if return_timings and timed_steps:
            if end_event is not None:
                end_event.record()
                end_event.synchronize()
                decode_seconds = start_event.elapsed_time(end_event) * 1e-3
            else:
                decode_seconds = time.perf_counter() - start

        new_tokens = s.tokens[:, :steps].clone()
        num_new = _num_new_tokens(new_tokens, stops)
        if stops:  # drop the columns after every row stopped (how many ran depends on check_every)
            new_tokens = new_tokens[:, : int(num_new.max())]
        width = new_tokens.shape[1]

        def taken(buffer: Tensor | None) -> Tensor | None:
            return None if buffer is None else buffer[:, :width].clone()

        return DecodeOutput(
            sequences=torch.cat([ids, new_tokens], dim=1),
            new_tokens=new_tokens,
            num_new_tokens=num_new,
            prompt_attention_mask=mask,
            decode_seconds=decode_seconds,
            timed_steps=timed_steps if return_timings else 0,
            token_logprobs=taken(s.token_logprobs),
            top_ids=taken(s.top_ids),
            top_logprobs=taken(s.top_logprobs),
            ranks=taken(s.ranks),
        )


def _temperature_key(temperature: float | Tensor) -> tuple:
    if isinstance(temperature, Tensor):
        return ("per-row", tuple(temperature.reshape(-1).tolist()))
    return ("scalar", float(temperature))


class FlashSamplingDecoder(StaticCacheDecoder):
    """Decoding with :class:`FlashSamplingHead` as the sampler.

    Example::

        model = AutoModelForCausalLM.from_pretrained(..., dtype=torch.bfloat16).cuda().eval()
        decoder = FlashSamplingDecoder(model)            # checks the model once
        out = decoder.generate(batch["input_ids"], batch["attention_mask"], max_new_tokens=128,
                               temperature=0.7, seed=1234, stop_token_ids=[tokenizer.eos_token_id])
        out.new_tokens, out.num_new_tokens
    """

    @torch.no_grad()
    def generate(
        self,
        input_ids: Tensor | Sequence[Sequence[int]],
        attention_mask: Tensor | None = None,
        *,
        max_new_tokens: int,
        temperature: float | Tensor = 1.0,
        top_k: int | Tensor | None = None,
        top_p: float | Tensor | None = None,
        min_p: float | Tensor | None = None,
        seed: int | Tensor = 0,
        offset: int | Tensor = 0,
        stop_token_ids: Sequence[int] | Tensor | None = None,
        pad_token_id: int | None = None,
        max_cache_len: int | None = None,
        return_timings: bool = False,
        return_logprobs: bool = False,
        top_logprobs: int = 0,
        logprobs_mode: str = "processed",
        repetition_penalty: float | Tensor | None = None,
        frequency_penalty: float | Tensor | None = None,
        presence_penalty: float | Tensor | None = None,
    ) -> DecodeOutput:
        """Samples up to ``max_new_tokens`` tokens per prompt.

        Args:
            input_ids: ``[B, P]`` int tensor of left-padded prompts (with ``attention_mask``)
                or a list of token-id lists of any lengths (left-padded here).
            attention_mask: ``[B, P]`` 0/1, left padding only; default all ones.
            temperature: float (0 = greedy) or ``[B]`` tensor (per row; moved to the model's
                device once).
            top_k, top_p, min_p: truncation as in ``flashsampling_cuda.sample`` (int/float or
                ``[B]`` tensor on the model's device; None or -1/0, 1, 0: off).
            seed: int or 0-d tensor: batch-wide, row ``b`` draws noise stream ``b``; or a
                ``[B]`` int64 tensor of per-request seeds (stream 0), so a request's tokens do
                not depend on the batch around it.
            offset: noise offset of the first token; step ``t`` uses ``offset + t``.
            stop_token_ids: a row stops after sampling one of these (it is kept in the output);
                its later tokens are ``pad_token_id``. Decoding ends early once every row stopped.
            pad_token_id: default: the model's generation config, else the first stop token, else 0.
            max_cache_len: static cache length (default: P + max_new_tokens rounded up to 64).
            return_timings: fill ``decode_seconds`` / ``timed_steps`` (the graph-replayed steps).
            return_logprobs: fill ``token_logprobs`` ``[B, n]``, each sampled token's
                log-probability, from the op's own output (no logits written for it).
            top_logprobs: with ``return_logprobs``, also each step's ``N`` (<= 64) most probable
                tokens and their log-probabilities (``top_ids``, ``top_logprobs`` ``[B, n, N]``)
                and the sampled tokens' ranks (``ranks``): OpenAI-style logprobs, computed by the
                op from logits it keeps to itself (a compact ``output_scores``).
            logprobs_mode: ``"processed"`` (default): the distribution sampled from (the model's
                scaling / soft-cap, temperature, truncation); ``"raw"``: ``log_softmax`` of
                ``hidden @ lm_head.weight.T`` (before the model's scaling or soft-cap), as in
                ``flashsampling_cuda.sample``. Greedy rows report temperature 1.
            repetition_penalty, frequency_penalty, presence_penalty: vLLM's penalties as in
                ``flashsampling_cuda.sample`` (float or ``[B]`` tensor; 1, 0, 0: off) over each
                row's prompt (its padding excluded) and the tokens generated so far, kept in a
                :class:`flashsampling_cuda.PenaltyState` of the session (``O(B * cache length)``
                memory) that each step updates on the device, inside the captured graph.
        """
        if isinstance(temperature, Tensor):  # on the device once, not copied inside a captured step
            temperature = temperature.to(device=self.device, dtype=torch.float32)
        truncation = dict(top_k=top_k, top_p=top_p, min_p=min_p)
        parse_logprob_args(return_logprobs, top_logprobs, None, logprobs_mode, 0, self.device)  # before the prefill
        logprob_controls = dict(return_logprobs=return_logprobs, top_logprobs=top_logprobs,
                                logprobs_mode=logprobs_mode)
        penalties = {name: value.to(device=self.device, dtype=torch.float32) if isinstance(value, Tensor) else value
                     for name, value in (("repetition_penalty", repetition_penalty),
                                         ("frequency_penalty", frequency_penalty),
                                         ("presence_penalty", presence_penalty))}
        penalised = penalties_on(**penalties)
        sampler = self.head.sampler(temperature, **truncation, **logprob_controls)
        if penalised:
            sampler = self._penalised_sampler(temperature, dict(**truncation, **logprob_controls, **penalties))
        return self.generate_with_sampler(
            input_ids, attention_mask, sampler=sampler,
            sampler_key=("flashsampling", _temperature_key(temperature),
                         tuple(_temperature_key(v) if isinstance(v, Tensor) else v for v in truncation.values()),
                         tuple(logprob_controls.values()),
                         tuple(_temperature_key(v) if isinstance(v, Tensor) else v for v in penalties.values())),
            max_new_tokens=max_new_tokens,
            seed=seed, offset=offset, stop_token_ids=stop_token_ids, pad_token_id=pad_token_id,
            max_cache_len=max_cache_len, return_timings=return_timings,
            logprobs=top_logprobs if return_logprobs else None, penalty_history=penalised,
        )

    def _penalised_sampler(self, temperature: float | Tensor, controls: dict) -> Sampler:
        """A step sampler that reads the session's token history for the penalties and counts
        the step's tokens into it (no host sync: it runs inside the captured step)."""

        def sample(hidden: Tensor, seed: Tensor, offset: Tensor):
            state = self.penalty_state
            out = self.head(hidden, temperature=temperature, seed=seed, offset=offset, penalty_state=state, **controls)
            state.update((out if isinstance(out, Tensor) else out.tokens)[:, 0])
            return out

        return sample


def generate(model: nn.Module, input_ids, attention_mask=None, *, cuda_graph: bool = True, **kwargs) -> DecodeOutput:
    """One-shot :meth:`FlashSamplingDecoder.generate` (builds the decoder, its cache and graph
    each call; keep a :class:`FlashSamplingDecoder` to reuse them)."""
    return FlashSamplingDecoder(model, cuda_graph=cuda_graph).generate(input_ids, attention_mask, **kwargs)
