"""Runs one scheduled step: flat batch in, sampled tokens out.

In two halves.  prepare() builds the flat inputs (input ids, positions, slot mapping, query_start_loc, attention
metadata) from the persistent per-row block table and the scheduler's output; run() runs the model, projects only
the last position of each sampling request (logits_indices = query_start_loc[1:] - 1, DESIGN invariant 1), samples,
and brings the results to Python with one .tolist() (invariant 6).  Rows asking for prompt logprobs also project the
prompt positions of their chunk (worker/prompt_logprobs.py), whose scores join that same transfer.  With async scheduling the engine core prepares
step N+1 while step N runs on another thread; an input step N samples is filled in by run() from step N's output
tensor.
"""

from __future__ import annotations

import logging
import mmap
from dataclasses import dataclass, field

import numpy as np
import torch

from tokenspout import guidance
from tokenspout.config import CacheConfig, SchedulerConfig
from tokenspout.engine.messages import PromptLogprobs, TokenLogprobs
from tokenspout.models.attention import AttentionMetadata, PrefillChunk, causal_mask
from tokenspout.models.loader import LoadedModel
from tokenspout.sample.sampler import Sampler, SamplerOutput
from tokenspout.step_io import ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from tokenspout.structured_output.lazy import LazyStructuredOutputs
from tokenspout.tensors import long_tensor
from tokenspout.worker import prompt_logprobs
from tokenspout.worker.input_batch import InputBatch, RowAdd
from tokenspout.worker.prompt_logprobs import PromptLogprobsPlan
from tokenspout.worker.spec_verify import DraftProbs, verify_drafts

logger = logging.getLogger(__name__)


def kv_dtype(loaded: LoadedModel, cache: CacheConfig) -> torch.dtype:
    return torch.float16 if cache.kv_cache_dtype == "float16" else loaded.dtype


def kv_block_bytes(loaded: LoadedModel, block_size: int, dtype: torch.dtype) -> int:
    """KV bytes per cache block of `loaded`'s layers, its cache holding `dtype`."""
    a = loaded.arch
    return 2 * a.num_layers * block_size * a.num_kv_heads * a.head_dim * dtype.itemsize


def zeroed_kv_caches(num_layers: int, slots: int, num_kv_heads: int, head_dim: int,
                     dtype: torch.dtype) -> list[torch.Tensor]:
    """One zero [2, slots, num_kv_heads, head_dim] KV cache per layer, each in an anonymous memory map: the OS
    zero-fills a page when it is first touched, so start-up does not write the whole cache (torch.zeros of 1 GiB:
    ~0.6 s) and slots never used cost no memory.  Zeros rather than torch.empty: the SDPA decode path reads whole
    blocks under a mask, and a NaN left in an unwritten slot survives the mask (0 * NaN)."""
    numel = 2 * slots * num_kv_heads * head_dim
    caches = []
    for _ in range(num_layers):
        buf = mmap.mmap(-1, numel * dtype.itemsize)  # the tensor keeps the map alive
        caches.append(torch.frombuffer(buf, dtype=dtype, count=numel).view(2, slots, num_kv_heads, head_dim))
    return caches


@dataclass(slots=True)
class FlatBatch:
    positions: torch.Tensor  # [T] position of every token
    slot_mapping: torch.Tensor  # [T] where each token's K/V is written
    query_start_loc: torch.Tensor  # [R + 1]
    # The torch model's metadata for tokens kernel_tokens.. (None: the C decoder runs the whole batch)
    meta: AttentionMetadata | None
    decode_block_ids: torch.Tensor | None = None  # [kernel_tokens, nb] block table row of each C decoder token
    seq_lens: torch.Tensor | None = None  # [kernel_tokens] = positions + 1
    kernel_tokens: int = 0  # the first tokens, which the C decoder runs


@dataclass(slots=True)
class PreparedStep:
    """A scheduled step with its host-side inputs built (ModelRunner.prepare), ready for ModelRunner.run."""

    entries: list[ScheduledRequest]  # decodes first
    rows: list[int] = field(default_factory=list)  # persistent row of each entry
    input_ids: torch.Tensor | None = None
    flat: FlatBatch | None = None  # None: nothing to compute (rows may still be released or added)
    # (positions in input_ids, rows of the previous step's sampled ids) of the inputs sampled by that step
    placeholders: tuple[torch.Tensor, torch.Tensor] | None = None
    sample_idx: list[int] = field(default_factory=list)  # entries that sample a token
    spec_idx: list[int] = field(default_factory=list)  # entries that verify drafts
    released: list[tuple[str, int]] = field(default_factory=list)  # (request id, row) given back
    added: list[RowAdd] = field(default_factory=list)  # requests taking a row this step
    prompt_lp: PromptLogprobsPlan | None = None  # prompt positions this step scores


class ModelRunner:
    def __init__(self, loaded: LoadedModel, cache: CacheConfig, sched: SchedulerConfig,
                 extra_block_bytes: int = 0, structured: LazyStructuredOutputs | None = None,
                 batch_invariant: bool = False):
        self.loaded = loaded
        # ModelConfig.batch_invariant: the kernels' batch-invariant build runs every step (a start error where it
        # cannot)
        self.batch_invariant = batch_invariant
        self.model = loaded.model
        a = loaded.arch
        self.device = torch.device("cpu")
        self.block_size = cache.block_size
        # extra_block_bytes: a draft model's KV cache, which shares the block ids (and so the count).
        self.kv_dtype = kv_dtype(loaded, cache)
        block_bytes = kv_block_bytes(loaded, cache.block_size, self.kv_dtype) + extra_block_bytes
        self.block_bytes = block_bytes  # (both caches' when a draft model shares the block ids)
        self.num_blocks = cache.num_gpu_blocks_override or int(cache.kv_cache_memory_gib * (1 << 30) // block_bytes)
        slots = self.num_blocks * self.block_size
        self.kv_caches = zeroed_kv_caches(a.num_layers, slots, a.num_kv_heads, a.head_dim, self.kv_dtype)
        self.group = a.num_heads // a.num_kv_heads
        self.max_num_seqs = sched.max_num_seqs
        max_blocks = -(-loaded.max_model_len // self.block_size)
        self.input_batch = InputBatch(sched.max_num_seqs, max_blocks, a.vocab_size, self.device)
        self._sample_pos: dict[str, int] = {}  # row of each sampling request in the last prepared step's output
        self._last_sampled: torch.Tensor | None = None  # the sampled ids of the last step run
        self.decoder = self._cpu_decoder(loaded)
        self.sampler = Sampler()
        self.structured = structured  # the grammar manager's handle (None: an engine without grammars)
        # Tests and debugging: called with (request ids, float32 logits) of every sampling step when set.
        self.logits_hook = None
        # q of the drafts a draft model proposed, by row (written by spec_decode/draft_model.py)
        self.draft_probs = DraftProbs(sched.max_num_seqs, a.vocab_size)
        logger.info("KV cache: %d blocks of %d tokens (%.2f GiB, %s)", self.num_blocks, self.block_size,
                    self.num_blocks * block_bytes / (1 << 30), str(self.kv_dtype).removeprefix("torch."))

    def _cpu_decoder(self, loaded: LoadedModel):
        """The C decode kernels for small decode-only steps, when this CPU and model can use them (else None);
        with batch_invariant, the batch-invariant build for every step."""
        from tokenspout.kernels import decoder

        return decoder.build(loaded, self.kv_caches, self.block_size, invariant=self.batch_invariant)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.decoder.logits(hidden) if self.decoder is not None else self.model.compute_logits(hidden)

    # ---- one step ------------------------------------------------------------------------------------------
    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        """One step, synchronously: prepare() then run()."""
        return self.run(self.prepare(sched))

    def prepare(self, sched: SchedulerOutput) -> PreparedStep:
        """The host side of a step, from the scheduler's output alone (with async scheduling it runs while the
        previous step computes, so it reads nothing that step changes): rows, block table rows, the flat
        inputs and where the tokens sampled by the previous step go."""
        step = PreparedStep(sched.scheduled)
        for rid in sched.removed_request_ids:
            self.input_batch.release(rid, step.released)
        if sched.is_empty:
            self._sample_pos = {}
            return step
        # Decodes (query length 1) first: they share one batched attention call.
        entries = step.entries = sorted(sched.scheduled, key=lambda e: e.num_new_tokens != 1)
        rows = step.rows
        starts: list[int] = []
        lens: list[int] = []
        tokens: list[int] = []
        dst: list[int] = []
        src: list[int] = []
        plp = None
        for e in entries:
            req = e.request
            if e.prompt_lp is not None:
                plp = plp or prompt_logprobs.PlanBuilder()
                lo, hi = e.prompt_lp
                top_n = req.params.prompt_logprobs
                assert top_n is not None  # the scheduler plans prompt logprobs only for requests asking
                plp.add(req.request_id, req.token_ids, lo, hi, len(tokens) + lo - e.start, top_n)
            row = self.input_batch.ensure_row(req, step.added)
            self.input_batch.sync_blocks(row, e.block_ids)
            rows.append(row)
            starts.append(e.start)
            lens.append(e.num_new_tokens)
            tokens.extend(e.token_ids)
            if e.placeholder:
                pos = self._sample_pos.get(req.request_id)
                if pos is None:
                    raise RuntimeError(f"{req.request_id}: placeholder input without a sampled token in flight")
                dst.append(len(tokens))
                src.append(pos)
                tokens.append(0)
            tokens.extend(e.spec_token_ids)
        step.input_ids = long_tensor(tokens)
        step.prompt_lp = plp.build() if plp is not None else None
        if dst:
            step.placeholders = (long_tensor(dst), long_tensor(src))
        step.flat = self.flat_batch(rows, starts, lens, self.decoder)
        step.spec_idx = [i for i, e in enumerate(entries) if e.samples and e.spec_token_ids]
        step.sample_idx = [i for i, e in enumerate(entries) if e.samples and not e.spec_token_ids]
        self._sample_pos = {entries[i].request.request_id: j for j, i in enumerate(step.sample_idx)}
        return step

    @torch.inference_mode()
    def run(self, step: PreparedStep) -> ModelRunnerOutput:
        """The model side of a prepared step: forward, logits of the sampling rows, sampler, one transfer."""
        self.input_batch.apply(step.released, step.added)  # rows' sampling state changes here, in step order
        if step.flat is None:
            self._last_sampled = None
            return ModelRunnerOutput(sampled={})
        entries, rows, input_ids = step.entries, step.rows, step.input_ids
        assert input_ids is not None  # built with step.flat
        if step.placeholders is not None:
            # The tokens the previous step sampled, straight from its output tensor.
            dst, src = step.placeholders
            assert self._last_sampled is not None  # a placeholder follows a step that sampled
            input_ids[dst] = self._last_sampled[src]
        qsl = step.flat.query_start_loc
        plan = step.prompt_lp
        logits = None
        if self._fuses_logits(step, len(input_ids)):
            flat = step.flat
            assert self.decoder is not None  # (_fuses_logits checked it)
            hidden, logits = self.decoder.forward_logits(input_ids, flat.positions, flat.slot_mapping,
                                                         flat.decode_block_ids, flat.seq_lens)
        else:
            hidden = self.forward(self.model, self.decoder, self.kv_caches, input_ids, step.flat)
        scored = (plan, prompt_logprobs.score(plan, hidden, self._logits)) if plan is not None else None

        sample_idx = step.sample_idx
        spec_result = self._verify(entries, step.spec_idx, rows, qsl, hidden) if step.spec_idx else {}
        if not sample_idx:
            self._last_sampled = None
            result = ModelRunnerOutput(sampled=spec_result)
            if scored is not None:  # prefill chunks only: their scores are the step's one transfer
                result.prompt_logprobs = prompt_logprobs.unpack(scored[0], scored[1].reshape(-1).tolist())
            return result
        if logits is None:
            sel = long_tensor(sample_idx)
            logits_indices = qsl[1:][sel] - 1
            logits = self._logits(hidden[logits_indices])
        guidance.combine(logits, entries, sample_idx, qsl, hidden, self._logits)
        sample_rows = [rows[i] for i in sample_idx]
        req_ids = [entries[i].request.request_id for i in sample_idx]
        if self.logits_hook is not None:
            self.logits_hook(req_ids, logits)
        md = self.input_batch.sampling.metadata(sample_rows)
        grammars = [r if entries[i].request.params.structured_outputs is not None else None
                    for i, r in zip(sample_idx, req_ids)]
        if any(grammars):  # (the manager is never touched by a step without grammar requests)
            assert self.structured is not None and self.structured.manager is not None
            md.grammar_bitmask = self.structured.manager.grammar_bitmask(grammars)
        out = self.sampler(logits, md)
        self._last_sampled = out.sampled_token_ids
        result = self._to_python(out, req_ids, [entries[i].request.params.logprobs for i in sample_idx], scored)
        self.input_batch.sampling.append_tokens(sample_rows, [result.sampled[r] for r in req_ids])
        result.sampled.update(spec_result)
        return result

    def _fuses_logits(self, step: PreparedStep, num_tokens: int) -> bool:
        """The step's logits come with its hidden states from one call of the C decoder: a step of decodes only
        (one token each) whose every token samples, no prompt logprobs, no drafts to verify."""
        return (self.decoder is not None and step.flat is not None and step.flat.meta is None
                and step.prompt_lp is None and not step.spec_idx and len(step.sample_idx) == num_tokens
                and num_tokens == len(step.entries) and num_tokens <= self.decoder.max_tokens)

    def _verify(self, entries, spec_idx: list[int], rows: list[int], qsl: torch.Tensor,
                hidden: torch.Tensor) -> dict[str, list[int]]:
        """Logits of every drafted position (+ the bonus one) of each speculating request, verified exactly."""
        drafts = [entries[i].spec_token_ids for i in spec_idx]
        ends = qsl[1:][torch.tensor(spec_idx, dtype=torch.int64)]
        idx = torch.cat([torch.arange(int(e) - len(d) - 1, int(e)) for e, d in zip(ends, drafts)])
        logits = self._logits(hidden[idx])
        spec_rows = [rows[i] for i in spec_idx]
        # Draft-model drafts come with their probabilities q (n-gram drafts have none: q is a point mass).
        q = self.draft_probs.read(spec_rows, max(map(len, drafts)))
        emitted = verify_drafts(logits, spec_rows, drafts, self.input_batch.sampling,
                                self._draft_bitmask([entries[i].request for i in spec_idx], drafts), q)
        self.input_batch.sampling.append_tokens(spec_rows, emitted)
        return {entries[i].request.request_id: toks for i, toks in zip(spec_idx, emitted)}

    def _draft_bitmask(self, reqs, drafts: list[list[int]]) -> torch.Tensor | None:
        """Grammar masks of every verified position (a request's k-th row: its grammar after its first k drafts),
        or None when no speculating request has a grammar."""
        so = self.structured.active() if self.structured is not None else None
        if so is None or all(r.params.structured_outputs is None for r in reqs):
            return None
        ids = [r.request_id if r.params.structured_outputs is not None else None
               for r, d in zip(reqs, drafts) for _ in range(len(d) + 1)]
        return so.grammar_bitmask(ids, {r.request_id: d for r, d in zip(reqs, drafts)})


    def flat_batch(self, rows: list[int], starts: list[int], lens: list[int], decoder=None) -> FlatBatch:
        """Positions, slot mapping, query_start_loc and attention metadata of a flat batch: request i sits at
        persistent row rows[i] and computes lens[i] tokens from position starts[i].  Requests with one token
        (decodes) must come first.  The draft proposer builds its batches with this too (same block table).
        With a C decoder that takes the batch (decode-only, small), the metadata it needs instead."""
        if decoder is not None and len(rows) <= decoder.max_tokens and all(n == 1 for n in lens):
            return self._decode_batch(rows, starts)
        rows_t = torch.tensor(rows, dtype=torch.int64)
        starts_t = torch.tensor(starts, dtype=torch.int64)
        lens_t = torch.tensor(lens, dtype=torch.int64)
        qsl = torch.zeros(len(rows) + 1, dtype=torch.int64)
        torch.cumsum(lens_t, 0, out=qsl[1:])
        num_tokens = int(qsl[-1])
        # position of every token = its request's computed count + offset within this step's chunk
        tok_req = torch.repeat_interleave(torch.arange(len(rows)), lens_t)
        positions = starts_t[tok_req] + (torch.arange(num_tokens) - qsl[:-1][tok_req])
        bs = self.block_size
        tok_rows = rows_t[tok_req]
        slot_mapping = self.input_batch.block_table[tok_rows, positions // bs] * bs + positions % bs
        nd = 0
        while nd < len(lens) and lens[nd] == 1:
            nd += 1
        if decoder is not None and num_tokens <= decoder.max_tokens:
            # The C decoder writes every token's K/V before any attention, and each token attends to its own
            # request's cache up to its own position: causal attention for any query length.  So a small step
            # with verification rows (or short chunks) runs there too, token by token, not only pure decodes.
            k = num_tokens
        elif decoder is not None and nd <= decoder.max_tokens:
            # A larger step (decodes + prefill chunks): the decode rows still run through the C decoder and only
            # the chunks through the torch model.  Requests are independent, so the two forwards are exact.
            k = nd
        else:
            return FlatBatch(positions, slot_mapping, qsl,
                             self._attention_metadata(nd, rows_t, starts_t, lens_t, qsl, slot_mapping))
        seq_lens = positions[:k] + 1
        block_ids = self.input_batch.block_table[tok_rows[:k], : -(-int(seq_lens.max()) // bs)] if k else None
        meta: AttentionMetadata | None = None
        if k < num_tokens:
            meta = self._attention_metadata(0, rows_t[nd:], starts_t[nd:], lens_t[nd:], qsl[nd:] - k,
                                            slot_mapping[k:])
        return FlatBatch(positions, slot_mapping, qsl, meta, block_ids, seq_lens, k)

    def _decode_batch(self, rows: list[int], starts: list[int]) -> FlatBatch:
        """flat_batch of a step of decodes only, for the C decoder: the same tensors, computed in numpy over the
        block table's shared memory (a dozen torch ops cost ~0.2 ms a step, ~3% of a batch-1 step here)."""
        bs = self.block_size
        r = np.array(rows, dtype=np.int64)
        pos = np.array(starts, dtype=np.int64)
        bt = self.input_batch.block_table_np
        slots = bt[r, pos // bs] * bs + pos % bs
        block_ids = bt[r, : int(pos.max()) // bs + 1]  # a copy (fancy indexing): see input_batch.py, Threads
        qsl = np.arange(len(rows) + 1, dtype=np.int64)
        return FlatBatch(torch.from_numpy(pos), torch.from_numpy(slots), torch.from_numpy(qsl), None,
                         torch.from_numpy(block_ids), torch.from_numpy(pos + 1), len(rows))

    @staticmethod
    def forward(model, decoder, kv_caches: list[torch.Tensor], input_ids: torch.Tensor, flat: FlatBatch,
                num_layers: int | None = None) -> torch.Tensor:
        """Hidden states of a flat batch: through the C decoder when flat_batch chose it, else the torch model."""
        k = flat.kernel_tokens
        if flat.meta is None:
            return decoder.forward(input_ids, flat.positions, flat.slot_mapping, flat.decode_block_ids, flat.seq_lens)
        rest = model(input_ids[k:], flat.positions[k:], kv_caches, flat.meta, num_layers=num_layers)
        if not k:
            return rest
        first = decoder.forward(input_ids[:k], flat.positions[:k], flat.slot_mapping[:k], flat.decode_block_ids,
                                flat.seq_lens)
        return torch.cat([first, rest])

    def _attention_metadata(self, nd: int, rows_t, starts_t, lens_t, qsl, slot_mapping) -> AttentionMetadata:
        bs = self.block_size
        dec_blocks = dec_mask = None
        if nd:
            seq_lens = starts_t[:nd] + 1
            nb = -(-int(seq_lens.max()) // bs)
            dec_blocks = self.input_batch.block_table[rows_t[:nd], :nb].reshape(-1)
            if self.decoder is None:  # the C kernel needs no mask
                pos = torch.arange(nb * bs)
                dec_mask = (pos[None, :] < seq_lens[:, None])[:, None, None, :]
        prefills = []
        for i in range(nd, len(rows_t)):
            ctx = int(starts_t[i] + lens_t[i])
            blocks = self.input_batch.block_table[int(rows_t[i]), : -(-ctx // bs)].clone()  # a copy: see input_batch.py, Threads
            prefills.append(PrefillChunk(int(qsl[i]), int(qsl[i + 1]), blocks,
                                         ctx, causal_mask(int(lens_t[i]), ctx, self.group, self.device)))
        return AttentionMetadata(slot_mapping, bs, nd, dec_blocks, dec_mask, prefills,
                                 decode_seq_lens=seq_lens if nd else None,
                                 kernels=self.decoder.lib if self.decoder is not None else None)

    @staticmethod
    def _to_python(out: SamplerOutput, req_ids: list[str], want: list[int | None],
                   prompt_lp: tuple[PromptLogprobsPlan, torch.Tensor] | None = None) -> ModelRunnerOutput:
        plp: dict[str, PromptLogprobs] = {}
        if out.logprobs is None or all(w is None for w in want):
            if prompt_lp is None:
                ids = out.sampled_token_ids.tolist()  # the one device->host transfer of the step
            else:  # one transfer for the sampled ids and the prompt scores (float64 holds token ids exactly)
                b = len(req_ids)
                flat = torch.cat([out.sampled_token_ids.double(), prompt_lp[1].reshape(-1)]).tolist()
                ids = [int(t) for t in flat[:b]]
                plp = prompt_logprobs.unpack(prompt_lp[0], flat[b:])
            return ModelRunnerOutput(sampled={r: [t] for r, t in zip(req_ids, ids)}, prompt_logprobs=plp)
        lp = out.logprobs
        # Processed logprobs are -inf for dropped tokens; JSON has no -inf, so report vLLM's -9999 floor.
        lp.logprobs.clamp_(min=-9999.0)
        # One transfer for ids, ranks and logprobs together (float64 holds token ids exactly).
        packed_t = torch.cat([out.sampled_token_ids[:, None].double(), lp.ranks[:, None].double(),
                              lp.token_ids.double(), lp.logprobs.double()], dim=1)
        if prompt_lp is None:
            packed = packed_t.tolist()
        else:  # the prompt scores ride along in the same transfer
            width = packed_t.shape[1]
            flat = torch.cat([packed_t.reshape(-1), prompt_lp[1].reshape(-1)]).tolist()
            packed = [flat[i * width : (i + 1) * width] for i in range(len(req_ids))]
            plp = prompt_logprobs.unpack(prompt_lp[0], flat[len(req_ids) * width :])
        n = lp.token_ids.shape[1]
        sampled, logprobs = {}, {}
        for r, w, row in zip(req_ids, want, packed):
            sampled[r] = [int(row[0])]
            if w is not None:
                ids = [int(x) for x in row[2 : 2 + n]]
                lps = row[2 + n :]
                logprobs[r] = [TokenLogprobs(lps[0], int(row[1]), ids[1 : 1 + w], lps[1 : 1 + w])]
        return ModelRunnerOutput(sampled=sampled, logprobs=logprobs, prompt_logprobs=plp)
