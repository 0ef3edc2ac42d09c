"""A prompt's last token prefilled with its final chunk, not as a decode step of its own.

mlx-lm's `BatchGenerator` prefills a prompt but for its last token, and runs that token as
the sequence's first decode step: one more pass over every weight of the model before the
first token exists (~7 ms of a 256-token prompt's ~90 on the small float32 demo model
here, ~23 of ~370 on the medium one). Here the final chunk carries the last token too.
Every block but the last computes it with the chunk's other rows (one row more in each
product); the last block runs the other rows for the cache only and the last row alone
(engine/last_block.py), and the LM head reads that one row. The generation step that
follows samples the first token from those logits with mlx-lm's own samplers and logits
processors instead of running the model. In process on the demo models, from prompts
to their first tokens: 1.01-1.12x sooner for one 256-token prompt, 1.13-1.29x for 8 or 32
prompts of several lengths (docs/benchmarks.md); the logits within float32 rounding of
the separate step's.

It applies to a chunk in which some prompt ends, within the step's size (a prompt that
goes on is prefilled with it as mlx-lm would): rows of several widths are padded on the
left (mlx-lm pads a chunk on the right), so such a chunk must be its batch's first (a
batch cache takes left padding only while empty). Any other chunk, and a model whose last
block or caches do not qualify (`last_block.split_reason`), takes mlx-lm's own path.
"""

from __future__ import annotations

import weakref
from typing import Any

import mlx.core as mx
from mlx_lm.generate import BatchGenerator, GenerationBatch, PromptProcessingBatch

from engine import last_block


class FinalChunkGenerator(BatchGenerator):
    """mlx-lm's `BatchGenerator` whose prompt batches prefill a prompt's last token with
    its final chunk; `first_logits` holds, per uid, the logits read from that chunk until
    the sequence's generation starts from them."""

    def __init__(self, model: Any, **kwargs: Any) -> None:
        super().__init__(model, **kwargs)
        self.first_logits: dict[int, mx.array] = {}
        _adopt(self._prompt_batch, self)

    def _make_batch(self, n: int) -> PromptProcessingBatch:
        return _adopt(super()._make_batch(n), self)

    def remove(self, uids: Any, return_prompt_caches: bool = False) -> Any:
        uids = list(uids)  # read twice: by mlx-lm, then here
        # The stored logits go after mlx-lm's remove: its `extract_cache` (for
        # `return_prompt_caches`) looks them up to cut a final chunk's cache.
        result = super().remove(uids, return_prompt_caches)
        for uid in uids:
            self.first_logits.pop(uid, None)
        return result

    def final_tokens(self, batch: PromptProcessingBatch, tokens: list[list[int]]
                     ) -> list[int | None] | None:
        """Per row, its prompt's lone last token where this chunk ends the prompt but for
        it (None where the prompt goes on); None for mlx-lm's own path: no row ends here,
        or the chunk would not fit the step size or its padding the cache."""
        rows = self._currently_processing
        if batch is not self._prompt_batch or not tokens or len(rows) != len(tokens):
            return None
        last = [segments[0][0] if len(segments) == 1 and len(segments[0]) == 1 else None
                for segments, _, _ in rows]
        if all(token is None for token in last):
            return None
        widths = {len(t) + (token is not None) for t, token in zip(tokens, last, strict=True)}
        if max(widths) > self.prefill_step_size:
            return None
        # Rows of several widths are padded on the left, which a batch cache takes only
        # while it holds nothing (mlx-lm pads on the right, then moves the padding).
        if len(widths) > 1 and any(c.keys is not None for c in batch.prompt_cache):
            return None
        return last


class _FinalChunkBatch(PromptProcessingBatch):
    """A prompt batch whose final chunk carries the prompts' last tokens."""

    _owner: weakref.ref[FinalChunkGenerator]  # weak: the generator holds its batches

    @property
    def owner(self) -> FinalChunkGenerator:
        owner = self._owner()
        assert owner is not None, "a prompt batch outlived its generator"
        return owner

    def _copy(self) -> _FinalChunkBatch:
        batch = super()._copy()
        batch._owner = self._owner
        return batch

    def prompt(self, tokens: list[list[int]]) -> None:
        last = self.owner.final_tokens(self, tokens)
        if last is None:
            super().prompt(tokens)
            return
        # What the cache holds, as mlx-lm keeps it; the generation step adds the last token.
        for held, chunk in zip(self.tokens, tokens, strict=True):
            held += chunk
        # A prompt that ends here ends the row in its last token, so the last column is
        # every such prompt's last (another row's there is a prompt token like the rest).
        rows = [chunk + ([token] if token is not None else [])
                for chunk, token in zip(tokens, last, strict=True)]
        width = max(len(row) for row in rows)
        pads = [width - len(row) for row in rows]
        if any(pads):
            for c in self.prompt_cache:
                c.prepare(left_padding=pads)
        padded = mx.array([[0] * pad + row for pad, row in zip(pads, rows, strict=True)])
        with last_block.split_last_row():
            logits = self.model(padded, cache=self.prompt_cache)[:, -1, :]
        mx.eval(logits, [c.state for c in self.prompt_cache])
        mx.clear_cache()
        self.owner.first_logits.update(
            (uid, logits[i]) for i, (uid, token) in enumerate(zip(self.uids, last, strict=True))
            if token is not None)

    def extract_cache(self, idx: int) -> list[Any]:
        """mlx-lm's: the cache of the tokens the batch lists for that row. A final chunk's
        cache holds the prompt's last token too, which the tokens list only once the
        generation starts; it is cut back to them."""
        cache = super().extract_cache(idx)
        if self.uids[idx] in self.owner.first_logits:
            for c in cache:
                c.trim(1)
        return cache

    def generate(self, tokens: list[list[int]]) -> GenerationBatch:
        stash = self.owner.first_logits
        ready = [uid in stash for uid in self.uids]
        if not any(ready):
            return super().generate(tokens)
        if all(ready):
            return self._generate_from_logits(tokens)
        # Some rows' last tokens are still to run (a one-token prompt that joined now).
        order = list(self.uids)
        rest = [i for i, r in enumerate(ready) if not r]
        others = self.split(rest)  # this batch keeps the rows that have their logits
        batch = self._generate_from_logits([t for t, r in zip(tokens, ready, strict=True) if r])
        batch.extend(others.generate([tokens[i] for i in rest]))
        # mlx-lm pairs the new rows with its own list of them, in the order it split them;
        # rows that joined now come last there too, so this holds already as mlx-lm is.
        if batch.uids != order:
            batch.filter([batch.uids.index(uid) for uid in order])
        return batch

    def _generate_from_logits(self, tokens: list[list[int]]) -> GenerationBatch:
        """mlx-lm's generation batch, its first step reading the stored logits."""
        first = _FirstLogits(mx.stack([self.owner.first_logits.pop(u) for u in self.uids]))
        model, self.model = self.model, first
        try:
            batch = super().generate(tokens)
        finally:
            self.model = model
        batch.model = model
        return batch


class _FirstLogits:
    """Stands in for the model in a generation batch's first step: its logits are known."""

    def __init__(self, logits: mx.array) -> None:
        self.logits = logits

    def __call__(self, inputs: mx.array, cache: Any = None) -> mx.array:
        return self.logits[:, None, :]


def _adopt(batch: PromptProcessingBatch, owner: FinalChunkGenerator) -> PromptProcessingBatch:
    batch.__class__ = _FinalChunkBatch
    batch._owner = weakref.ref(owner)  # type: ignore[attr-defined]
    return batch
