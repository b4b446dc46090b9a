"""Draft-model proposer: a smaller model, or the target's own first L layers (self-draft), proposes k tokens
autoregressively for every speculating request -- batched over requests, one draft forward per draft position --
and keeps its probabilities q for the exact rejection sampler.

Where it runs (vLLM v1's shape).  Right after a target step (EngineCore.step, once the scheduler has appended the
emitted tokens), so its input is the just-accepted tokens; its drafts wait in `Request.spec_token_ids` for the
next schedule.  The scheduler allocates k lookahead slots for each request that samples (`num_lookahead_tokens`),
so the draft's KV at the positions it drafts into has a home; the draft uses the target's block table and slot
mapping.  Rejected draft positions need no rollback: the next forward over those positions overwrites them.

KV cache.  A separate draft model has its own cache (the same block ids, so the same number of blocks: the engine
budgets both).  Per request it remembers `computed`, the tokens whose draft KV is valid; its first forward of a
round feeds token_ids[computed:] (the tokens accepted since its last round, or a whole prompt after a pause or a
preemption) and further forwards one draft token each.  The self-draft needs no cache of its own: its layers
0..L-1 are the target's layers with the same inputs, so at every committed position their KV is exactly what the
target wrote, and the positions it drafts into are rewritten by the target's verification forward.

Sampling.  Draft logits go through the request's own processing (masks, logit_bias, temperature, min_p, top-k,
top-p; compute_processed_logits) and q = softmax of that, as the rejection sampler requires; greedy rows take the
argmax.  The draw is the sampler's two-level Gumbel-max with hashed noise keyed by (draft_seeds(seed), output
position): a pure function of the request's seed and position, independent of the noise the rejection sampler
uses at the same positions, so seeded requests stay reproducible.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from tokenspout.config import SpeculativeConfig
from tokenspout.core.request import Request
from tokenspout.models.llama import LlamaForCausalLM
from tokenspout.models.loader import LoadedModel, load_model
from tokenspout.sample.ops import rows_cpu
from tokenspout.sample.ops.draw import DEFAULT_BLOCK_SIZE, block_mass, draw_dense
from tokenspout.sample.ops.noise import row_keys
from tokenspout.sample.rejection_sampler import draft_seeds, probs_from_logits
from tokenspout.sample.sampler import compute_processed_logits
from tokenspout.worker.model_runner import ModelRunner, kv_block_bytes, zeroed_kv_caches

if TYPE_CHECKING:
    from tokenspout.kernels.decoder import CpuDecoder

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class DraftSource:
    """What runs as the draft: a model, the KV caches of the layers it runs, and how many layers (None: all)."""

    model: LlamaForCausalLM
    kv_caches: list[torch.Tensor]
    num_layers: int | None
    shares_target_cache: bool  # self-draft: the caches are the target's (always caught up)
    decoder: CpuDecoder | None = None  # C decode kernels over the same layers and caches


def load_draft_model(spec: SpeculativeConfig, target: LoadedModel, quantization: str | None) -> LoadedModel:
    """Loads spec.draft_model like the target (dtype, quantization) and checks it can draft for the target (same
    vocabulary)."""
    from tokenspout.config import ModelConfig

    draft = load_model(ModelConfig(model=spec.draft_model, dtype=_dtype_name(target.dtype),
                                   max_model_len=target.max_model_len, quantization=quantization))
    check_compatible(target, draft)
    return draft


def _dtype_name(dtype: torch.dtype) -> str:
    return "bfloat16" if dtype == torch.bfloat16 else "float32"


def check_compatible(target: LoadedModel, draft: LoadedModel) -> None:
    """The draft's token ids must mean what the target's mean: equal vocabulary sizes and identical tokenizers."""
    from tokenspout.engine.tokenizer import load_tokenizer

    if draft.arch.vocab_size != target.arch.vocab_size:
        raise ValueError(f"draft model {draft.path} has vocab_size {draft.arch.vocab_size}, the target "
                         f"{target.path} has {target.arch.vocab_size}: a draft model needs the target's tokenizer")
    if draft.path.resolve() == target.path.resolve():
        return
    try:
        d_tok, t_tok = load_tokenizer(draft.path), load_tokenizer(target.path)
    except ValueError as e:
        raise ValueError(f"cannot check that the draft model's tokenizer matches the target's: {e}") from e
    d_vocab, t_vocab = d_tok.get_vocab(), t_tok.get_vocab()
    if d_vocab != t_vocab:
        differ = sum(1 for t, i in t_vocab.items() if d_vocab.get(t) != i) + len(set(d_vocab) - set(t_vocab))
        raise ValueError(f"draft model {draft.path} has a different tokenizer from the target {target.path} "
                         f"({differ} vocabulary entries differ): a draft model needs the target's tokenizer")


def draft_block_bytes(draft: LoadedModel, block_size: int) -> int:
    """KV bytes per cache block of a separate draft model (added to the target's when sizing the cache); its cache
    holds the draft's own dtype."""
    return kv_block_bytes(draft, block_size, draft.dtype)


def _decoder(loaded: LoadedModel, caches: list[torch.Tensor], block_size: int,
             num_layers: int | None, invariant: bool) -> CpuDecoder | None:
    """The C decode kernels for the draft's small decode-only forwards (most of its forwards), when available
    (invariant: the target's --batch-invariant, which the draft's proposals, and so the accepted tokens, follow)."""
    from tokenspout.kernels import decoder

    return decoder.build(loaded, caches, block_size, num_layers, invariant=invariant)


def forward_params(model: LlamaForCausalLM, num_layers: int | None) -> int:
    """Weights one forward reads: the decoder layers it runs and the LM head (the embedding is a row lookup)."""
    from tokenspout.models.quant_linear import QuantLinear

    def weights(m: torch.nn.Module) -> int:  # parameters + the packed weights of QuantLinear layers
        return sum(p.numel() for p in m.parameters()) + sum(q.in_features * q.out_features for q in m.modules()
                                                             if isinstance(q, QuantLinear))

    layers = model.layers if num_layers is None else model.layers[:num_layers]
    return weights(layers) + weights(model.lm_head)


class DraftProposer:
    def __init__(self, runner: ModelRunner, source: DraftSource, num_speculative_tokens: int):
        self.runner = runner  # ModelRunner: persistent rows, block table, sampling state, flat-batch builder
        self.source = source
        self.k = num_speculative_tokens
        self.vocab_size = runner.input_batch.sampling.vocab_size
        self._computed: dict[str, int] = {}  # separate model: tokens with valid draft KV, per request

    @classmethod
    def build(cls, runner: ModelRunner, spec: SpeculativeConfig, draft: LoadedModel | None) -> DraftProposer:
        if draft is None:  # self-draft from the target's first layers
            n, layers = runner.loaded.arch.num_layers, spec.draft_layers
            if layers is None or not 1 <= layers < n:
                raise ValueError(f"draft_layers must be in [1, {n - 1}] for a target with {n} layers, "
                                 f"got {layers}")
            caches = runner.kv_caches[:layers]
            source = DraftSource(runner.model, caches, layers, True,
                                 _decoder(runner.loaded, caches, runner.block_size, layers, runner.batch_invariant))
        else:
            a = draft.arch
            slots = runner.num_blocks * runner.block_size
            caches = zeroed_kv_caches(a.num_layers, slots, a.num_kv_heads, a.head_dim, draft.dtype)
            source = DraftSource(draft.model, caches, None, False,
                                 _decoder(draft, caches, runner.block_size, None, runner.batch_invariant))
        return cls(runner, source, spec.num_speculative_tokens)

    def forget(self, request_id: str) -> None:
        """The request left its row (finished, aborted, preempted): its draft KV is gone with its blocks."""
        self._computed.pop(request_id, None)

    @torch.inference_mode()
    def propose(self, reqs: list[Request], num_drafts: list[int],
                blocks_of: Callable[[str], list[int]]) -> list[list[int]]:
        """Up to num_drafts[i] draft tokens for each decoding request (its KV computed up to its last token).
        Fewer where its blocks do not cover the lookahead positions (the scheduler could not allocate them)."""
        runner, bs = self.runner, self.runner.block_size
        rows, starts, want = [], [], []
        for req, d in zip(reqs, num_drafts):
            row = runner.input_batch.row_of[req.request_id]
            blocks = blocks_of(req.request_id)
            runner.input_batch.sync_blocks(row, blocks)
            n = req.num_tokens
            # The draft writes positions start .. n + d - 2; they must lie in the request's blocks.
            d = min(d, len(blocks) * bs - n + 1)
            start = req.num_computed_tokens if self.source.shares_target_cache else self._computed.get(
                req.request_id, 0)
            rows.append(row)
            starts.append(min(start, n - 1))
            want.append(max(d, 0))
        out: list[list[int]] = [[] for _ in reqs]
        active = [i for i, d in enumerate(want) if d > 0]
        if not active:
            return out
        # First forward: each request's tokens without draft KV (usually 1), decodes first (flat-batch layout).
        active.sort(key=lambda i: reqs[i].num_tokens - starts[i] != 1)
        tokens: list[int] = []
        for i in active:
            tokens.extend(reqs[i].token_ids[starts[i]:])
        last = self._forward(tokens, [rows[i] for i in active], [starts[i] for i in active],
                             [reqs[i].num_tokens - starts[i] for i in active])
        if not self.source.shares_target_cache:
            for i in active:
                self._computed[reqs[i].request_id] = reqs[i].num_tokens
        for j in range(max(want[i] for i in active)):
            if j:  # one more token per request still drafting: the draft just sampled, at the next position
                active = [i for i in active if want[i] > j]
                last = self._forward([out[i][-1] for i in active], [rows[i] for i in active],
                                     [reqs[i].num_tokens + j - 1 for i in active], [1] * len(active))
            for i, t in zip(active, self._sample([rows[i] for i in active], last, j).tolist()):
                out[i].append(t)
        return out

    def _forward(self, tokens: list[int], rows: list[int], starts: list[int], lens: list[int]) -> torch.Tensor:
        """Runs the draft over a flat batch and returns the logits of each request's last position [R, V]."""
        src = self.source
        flat = self.runner.flat_batch(rows, starts, lens, src.decoder)
        hidden = self.runner.forward(src.model, src.decoder, src.kv_caches, torch.tensor(tokens, dtype=torch.int64),
                                     flat, src.num_layers)
        last = hidden[flat.query_start_loc[1:] - 1]
        return src.decoder.logits(last) if src.decoder is not None else src.model.compute_logits(last)

    def _sample(self, rows: list[int], logits: torch.Tensor, j: int) -> torch.Tensor:
        """Draft token j of each row [R] (argmax on greedy rows, else a seeded draw from q); q kept for sampled
        rows.  The processing is the sampler's, at output position (tokens so far) + j."""
        md = self.runner.input_batch.sampling.metadata(rows)
        md.positions = md.positions + j
        processed = compute_processed_logits(logits, md)
        argmax = rows_cpu.argmax_rows(rows_cpu.load(), processed)
        if md.all_greedy:
            return argmax
        q = probs_from_logits(processed)
        keys = row_keys(draft_seeds(md.seeds), md.positions)
        drawn = draw_dense(processed, block_mass(q, DEFAULT_BLOCK_SIZE), keys, DEFAULT_BLOCK_SIZE)
        self.runner.draft_probs.write(rows, j, q, self.k)  # read by the verification of the next step
        return torch.where(md.is_greedy, argmax, drawn)
