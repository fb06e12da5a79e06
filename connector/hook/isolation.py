"""In-band isolation (worker process): the isolation mask inside vLLM's attention, so a chunk
vLLM computes in a request is the KV the store serves for it, and the same prompt gets the
same answer whatever is stored (docs/isolation-hook.md; where the method comes from:
docs/design.md#sources).

The hook wraps ``forward`` of each attention layer's implementation (vLLM's CPU back end;
any other is refused, loudly, and attention stays vLLM's). Each step the scheduler names the
requests whose scheduled tokens include chunk tokens (``IsolatedStep``). Per layer:

- rows of chunk tokens are computed here: each sees its own chunk causally and, in
  ``isolation: sys``, the sys keys, read from vLLM's paged cache through the block table
  (vLLM's slot mapping). A stored chunk was computed at virtual start ``v`` (right after sys, or
  ``virtual_gap`` past it) and is loaded with its keys rotated by ``p - v``; a chunk computed
  at ``p`` must see sys at the same distances, so the sys keys are rotated by ``+(p - v)`` for
  its scores, which is the same as rotating its queries by ``-(p - v)`` (RoPE scores depend
  on the difference). Scores inside the chunk are relative already; the keys vLLM wrote into
  its cache stay at actual positions, as a load writes them. All chunk rows of a step are one
  call of vLLM's kernel (``ChunkBatch``): each chunk a sub-request over a cache of the hook's
  own that holds what it sees, in order (its rotated sys, then its own run), causal, so no
  mask and no merge; one partial attention per chunk and part, merged by log-sum-exp
  (``chunkstore.kv.attention.attention_after_context``), is the reference it is tested
  against, and what the question rows below still use.
- with question re-weighting, the rows after the isolated chunks (question, decode) are
  computed here too: sys, then the chunks with their temperature and scale, then their own.
- with ``recompute_tokens``, the step that computes the first causal row after the chunks
  first recomputes the chunks' selected tokens (``recompute``), after the chunk rows and
  before the causal ones, so those read the blend.
- with ``relevant_last``, that same step rotates the keys of the chunks that move to their
  new positions in the cache (``moves``), after the chunk rows and before the recompute and
  the causal rows: from then on the question and what is generated read them there (a
  chunk the step loads whole was loaded rotated there: ``placed``, ``Loads.placed``). The
  tokens recomputed in such a request are recomputed where they are attended: rotated to
  their attended positions, each seeing the keys attended before it (``Reordered``: the
  cache holds the chunks in prompt order, so their KV is copied in attended order into a
  cache of the hook's own, where vLLM's kernel is causal in that order).
- a chunk recomputed whole whose rows the step computes anyway (``in_place``) is computed
  once: its rows are not chunk rows but join the recomputed tokens' attention, their
  queries rotated to where the chunk is attended (``InPlace``), and vLLM takes them through
  the rest of each layer; its KV in the cache is then the recomputed one, never isolated.
- chunks that missed inside a request's loaded run (``gaps``: vLLM counts them as loaded)
  are computed here in the request's first step, before anything reads them: their tokens
  through vLLM's modules (the recomputer), attending as chunk rows do (``Gaps``); a gap
  recomputed whole in that step (``gap_picks``) only by its recompute, once. A request
  whose gaps were not computed has their blocks reported as failed loads (vLLM computes
  them) and none of its chunks stored.
- every other row (plain requests, sys and question tokens, decode) goes to vLLM's own kernel,
  on a batch without the chunk rows, so no row pays for attention twice; a step with no chunk
  rows calls vLLM's forward untouched.
- each layer rotates with its own rotary (``LayerRotary``: Gemma 3's sliding layers at base
  1e4, global ones at 1e6), and a sliding-window layer passes its window to every kernel
  call: a chunk row sees the keys of sys and of its chunk within the window of the position
  it is computed at (its virtual one: the hook's cache holds sys, then the chunk, so with
  ``virtual_gap`` 0 its positions are the virtual ones; a gap turns the hook off,
  ``config.for_deployment``), the other rows the last ``window`` positions of the cache.

Where the parts live: ``vllm_attention`` is the only code that touches vLLM's attention
objects (it wraps each layer and hands the rest one ``LayerCall`` per layer call);
``step_split`` says which rows of a step are which (``StepSplit``, built once per step);
``step_attention`` runs a layer's phases in the order above; this module's ``IsolationHook``
holds the step (its plans and split) and what failed in it, and ties the three together.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from chunkstore.connector_config import ConnectorConfig
from chunkstore.kv.keys import Isolation
from chunkstore.kv.layer_rotary import LayerRotary
from chunkstore.kv.rope import RotaryConfig

from ..common import RequestPlan
from ..cpu_layout import CpuKVLayout
from ..sparse_reads import SparseReads
from .recompute import Blend, IsolatedCopy, Recomputer
from .step_attention import StepAttention
from .step_split import StepSplit, StepSplitter
from .vllm_attention import QKV, AttentionLayers, LayerCall, StepMetadata
from .vllm_attention import step_metadata as forward_step_metadata

if TYPE_CHECKING:  # vLLM's types at the boundary, for the type checker only
    from vllm.config import VllmConfig

log = logging.getLogger("chunkstore.connector")


class IsolationHook:
    def __init__(
        self,
        layout: CpuKVLayout,
        rotary: LayerRotary | RotaryConfig,  # each layer's (one for all: a RotaryConfig)
        config: ConnectorConfig,
        on_miss: Callable[[str], None],
        placed: Callable[[str], dict[int, int] | None] = lambda req_id: {},
        sparse: SparseReads | None = None,
    ) -> None:
        self.layout = layout
        if isinstance(rotary, RotaryConfig):
            rotary = LayerRotary.single(rotary)
        self.splitter = StepSplitter(
            layout,
            rotary,
            isolate_from_sys=config.isolation_mode is Isolation.SYS,
            virtual_gap=config.virtual_gap,  # chunks see sys from this far past its end
            reweight=config.quality.reweights_questions,
            on_miss=on_miss,
            placed=placed,
            sparse_of=sparse.of if sparse is not None else lambda req_id: (),
        )
        self.attention = StepAttention(
            layout,
            rotary,
            config.quality.question_temperature,
            math.log(config.quality.question_scale),
            sparse,
        )
        # What attends chunks where the kernel's window does not count (``for_deployment``
        # turns them off for a windowed model whose config names its windows)
        quality = config.quality
        self._unwindowed = [
            name
            for name, on in (
                ("virtual_gap", config.virtual_gap),
                ("relevant_last", quality.relevant_last),
                ("recompute", quality.recompute_chunks or quality.recompute_tokens),
                ("question re-weighting", quality.reweights_questions),
                ("fill_gaps", config.fill_gaps),
                ("sparse reads", config.sparse_threshold),
            )
            if on
        ]
        self.on_miss = on_miss  # a planned request not found in the batch (computed causally)
        self.recomputes = bool(config.quality.recompute_tokens or config.quality.recompute_chunks)
        self.rides = config.recompute_in_vllm_batch
        self.recomputer: Recomputer | None = None
        self._plans: list[RequestPlan] = []
        self._splits: dict[int, tuple[StepMetadata, StepSplit | None]] = {}
        self.isolated_tokens = 0  # chunk tokens served, since take_isolated_tokens
        self.failed_blocks: set[int] = set()  # blocks of gaps not computed, since taken
        self._layers: AttentionLayers | None = None
        self._riding = 0  # the step's recomputed rows after vLLM's in its batch (``ride``)

    # Installation ---------------------------------------------------------------------------

    def install(self, vllm_config: VllmConfig, layer_names: list[str]) -> str | None:
        """Wrap every attention layer's forward; or, if any layer is not one the hook can
        serve, none of them, and return why."""
        layers = AttentionLayers(vllm_config, layer_names)
        why = layers.refused()
        if why:
            return why
        if self._unwindowed and layers.windowed():
            return f"sliding window with {', '.join(self._unwindowed)} not supported"
        found = Recomputer.find(vllm_config, self.layout, layer_names)
        if isinstance(found, str):
            # Chunks then stay isolated: the answer the semantics give without recovery.
            report = log.error if self.recomputes else log.info
            report("chunkstore: no chunk or token is recomputed for answer quality: %s", found)
        else:
            self.recomputer = found
            why = found.ride(vllm_config, self._riders) if self.rides else "configured"
            if why:
                log.info("chunkstore: recomputed tokens take a pass of their own: %s", why)
        self._layers = layers
        layers.wrap(self._serve, lambda: self._riding)
        return None

    def _riders(self) -> list[Blend]:
        """The blends of the step vLLM's forward is about to run, which ride in its batch
        (``Recomputer.ride``): built from the first layer's attention metadata, before it."""
        self._riding = 0
        if not self._plans:
            return []
        assert self._layers is not None
        metadata = forward_step_metadata(self._layers.names[0])
        split = self._split(metadata, self._layers.call(0))
        blends = split.blends() if split is not None else []
        self._riding = sum(blend.positions.shape[0] for blend in blends)
        return blends

    def _serve(
        self,
        call: LayerCall,
        metadata: StepMetadata | None,
        qkv: QKV,
        kv_cache: torch.Tensor,
        output: torch.Tensor,
    ) -> bool:
        """A layer's attention, where the step has planned rows in it (``output`` computed:
        True); else vLLM's forward computes it (False)."""
        split = self._split(metadata, call) if self._plans else None
        if split is None:
            if self._riding:
                raise RuntimeError("recomputed rows rode in a batch the hook did not split")
            return False
        self.attention.attend(split, call, qkv, kv_cache, output, self.recomputer, self._riding)
        return True

    # Steps --------------------------------------------------------------------------------

    def begin_step(self, plans: list[RequestPlan]) -> None:
        self._plans = [plan for plan in plans if plan.isolation is not None]
        self._splits.clear()
        self._riding = 0

    def end_step(self) -> tuple[dict[str, IsolatedCopy], dict[str, dict[int, int]]]:
        """End the step; return, per request whose selected tokens were recomputed in it,
        the isolated KV they replaced (what saves of this step must store), and per request
        whose chunks moved in it, each moved chunk's start and shift (saves of this step
        read its keys rotated)."""
        copies: dict[str, IsolatedCopy] = {}
        shifts: dict[str, dict[int, int]] = {}
        layers = len(self._layers.names) if self._layers is not None else 0
        splits = [split for _, split in self._splits.values() if split is not None]
        filled = {
            gap.blend.req_id for s in splits for gap in s.gaps if gap.blend.next_layer == layers
        }
        blended = {
            r.blend.req_id
            for s in splits
            for r in s.recomputes
            if r.blend is not None and r.blend.next_layer == layers
        }
        for plan in self._plans:
            step = plan.isolation
            if step is not None and (
                (step.gaps and plan.req_id not in filled)
                or (step.gap_picks and plan.req_id not in blended)
            ):
                self._gaps_failed(plan)
        for _, split in self._splits.values():
            if split is None:
                continue
            for recompute in split.recomputes:
                blend = recompute.blend
                if blend is None or self.recomputer is None:
                    continue
                copy = self.recomputer.isolated_copy(blend)
                if copy is not None:
                    copies[blend.req_id] = copy
            for move in split.moves:
                shifts.setdefault(move.req_id, {})[move.start] = move.shift
        self._plans = []
        self._splits.clear()
        self._riding = 0
        return copies, shifts

    def _gaps_failed(self, plan: RequestPlan) -> None:
        """A request's gaps were not computed: vLLM computes their blocks (a failed load)
        and none of the request's chunks is stored."""
        step = plan.isolation
        assert step is not None
        size = self.layout.block_size
        positions = [p for p, _ in step.gaps] + [
            p for lo, hi in step.gap_picks for p in range(lo, hi)
        ]
        self.failed_blocks |= {plan.block_ids[position // size] for position in positions}
        log.error(
            "chunkstore: request %s: the chunks that missed inside its loaded run were not "
            "computed; vLLM computes them (a failed load)",
            plan.req_id,
        )
        self.on_miss(plan.req_id)

    def take_failed_blocks(self) -> set[int]:
        taken, self.failed_blocks = self.failed_blocks, set()
        return taken

    def take_isolated_tokens(self) -> int:
        taken, self.isolated_tokens = self.isolated_tokens, 0
        return taken

    def _split(self, metadata: StepMetadata | None, call: LayerCall) -> StepSplit | None:
        """Which rows of this step's batch are chunk rows, and the batch vLLM's kernel gets
        for the rest: built once per step (every layer shares the metadata object)."""
        if metadata is None:
            return None
        cached = self._splits.get(id(metadata))
        if cached is not None and cached[0] is metadata:
            return cached[1]
        split = self.splitter.split(metadata, self._plans, call, self.recomputer)
        if split is not None:
            self.isolated_tokens += split.isolated_tokens()
        self._splits[id(metadata)] = (metadata, split)
        return split
