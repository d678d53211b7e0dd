"""Preallocated step inputs: one pinned host arena, one device twin, one copy per step.

Every per-step input (token ids, prefill metadata, decode slots and KV lengths, logit rows) is a
typed view at a fixed offset of one byte arena. A refill writes a ``StepPlan`` into the host
views with numpy, padding to the chosen bucket, and ``upload`` issues the step's single
host-to-device copy. The device views never move, so graphs captured over them stay valid; a
graph may also capture the upload itself as its first node (the runner does), and then each
replay copies the arena as the host left it.

Inputs for a bucket ``(B, Tp)`` (``graphs.Bucket``: B decode rows, Tp prefill tokens) are the
leading ``[:n]`` slices of the arena's views, so every bucket shares one arena.

The logits processors' inputs (each row's penalties; the bias entries of the requests whose
prompt starts in the step) sit in a second, smaller arena with a copy of its own, which only
the processed sampling stage issues: a step without processors neither fills nor copies it.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import torch

from ..graphs import Bucket
from ..kernels.logits_processors import MAX_BIASED
from ..kernels.varlen import PAD_SLOT_ID, PrefillMetadata, fill_prefill_metadata, max_chunks_for
from .plan import StepPlan
from .replay import Replay, fill_replay, layout_rows
from .step_inputs import StepInputs

__all__ = ["METADATA_SHAPES", "StepBuffers"]

# the prefill metadata of this many step shapes kept for refills of the same shape (0: none)
METADATA_SHAPES = 64

_ALIGN = 64
# padding values where they are not zero: padding rows have no slot and keep every token (top-p 1)
_PAD = {"decode_slots": PAD_SLOT_ID, "sample_slots": PAD_SLOT_ID, "top_p": 1, "repetition": 1,
        "admit_slots": PAD_SLOT_ID, "processor_slots": PAD_SLOT_ID}


class _Arena:
    """Named typed arrays packed into one byte buffer on the host (pinned) and on the device."""

    def __init__(self, spec: dict[str, tuple[np.dtype, int]], device: torch.device):
        offsets, total = {}, 0
        for name, (dtype, n) in spec.items():
            offsets[name] = total
            total += -(-np.dtype(dtype).itemsize * max(n, 1) // _ALIGN) * _ALIGN
        pin = device.type == "cuda"
        self.host = torch.zeros(total, dtype=torch.uint8, pin_memory=pin)
        self.device = self.host if device.type == "cpu" else torch.zeros(total, dtype=torch.uint8, device=device)
        host_np = self.host.numpy()
        self.np: dict[str, np.ndarray] = {}
        self.dev: dict[str, torch.Tensor] = {}
        for name, (dtype, n) in spec.items():
            o, nbytes = offsets[name], np.dtype(dtype).itemsize * n
            self.np[name] = host_np[o : o + nbytes].view(dtype)
            torch_dtype = torch.from_numpy(np.zeros(0, dtype)).dtype
            self.dev[name] = self.device[o : o + nbytes].view(torch_dtype)
        self.nbytes = total
        self.bytes = host_np  # the host arena as bytes
        self.offsets = offsets
        for name, view in self.np.items():
            view[:] = _PAD.get(name, 0)
        # external: recorded inside a graph capture it becomes an event-record node, which each
        # replay records, so ``wait`` can wait for exactly the copy of a captured upload too
        self._copy_done = torch.cuda.Event(external=True) if device.type == "cuda" else None

    def wait(self) -> None:
        """Wait until the last copy has left the host arena, which may then be overwritten."""
        if self._copy_done is not None:
            self._copy_done.synchronize()

    def upload(self) -> None:
        """Copy the host arena to the device (asynchronous on the current stream; inside a graph
        capture, a copy node and an event-record node of the graph)."""
        if self.device is self.host:
            return
        self.device.copy_(self.host, non_blocking=True)
        self._copy_done.record()


class StepBuffers:
    def __init__(self, max_decode: int, max_prefill_tokens: int, max_prefill_seqs: int, chunk_size: int,
                 device="cpu", max_drafts: int = 0, record_stride: int = 0):
        """max_drafts: the most drafts a verify bucket's sequences carry (each a logit row);
        record_stride: the record rows a slot of the state pool has (``StatePool.drafts``), which
        a verify step's Mamba2 layers replay from and keep drafts in (``runtime.replay``)."""
        self.device = torch.device(device)
        self.max_decode, self.max_prefill_tokens = max_decode, max_prefill_tokens
        self.max_prefill_seqs, self.chunk_size, self.max_drafts = max_prefill_seqs, chunk_size, max_drafts
        self.record_stride = record_stride
        T, S = max_prefill_tokens, max_prefill_seqs
        C = max_chunks_for(T, S, chunk_size)
        R = S * (1 + max_drafts) + max_decode  # logit rows
        i32, i64 = np.int32, np.int64
        spec = {
            "logit_rows": (i64, R),
            # sampling, per logit row
            "seed": (i64, R), "position": (i64, R), "temperature": (np.float32, R), "top_p": (np.float32, R),
            "top_k": (i32, R), "sample_slots": (i32, R),
            "decode_slots": (i32, max_decode),
            "decode_kv_lens": (i32, max_decode),
            "cu_seqlens": (i32, S + 1), "slot_idx": (i32, S),
            "has_initial_state": (i32, S), "context_lens": (i32, S), "chunk_seq": (i32, C),
            "chunk_start": (i32, C), "chunk_end": (i32, C), "seq_chunk_start": (i32, S + 1),
            "final_slot": (i32, S), "snapshot_slot": (i32, S), "snapshot_row": (i32, S),
            # per packed row, the row whose experts it takes: itself, or a padding row the step's
            # first live one (``moe_route``'s route_as: padding adds no expert to read)
            "route_as": (i32, T + max_decode),
            # last, the arrays as long as the prefill tokens, which the refill writes over the
            # bucket's part only, and a verify bucket's Mamba2 layout, which only a verify
            # step's refill writes (all of the bucket's part) and only a verify step reads
            "input_ids": (i64, T + max_decode), "seq_idx": (i32, T),
        }
        if max_drafts:
            E = layout_rows(T, S, max_drafts)
            spec.update({f"replay_{k}": (i32, n) for k, n in self._meta_sizes(E).items()})
            spec.update(replay_src=(i32, E), replay_own=(i32, T), replay_record=(i32, T))
        self.arena = _Arena(spec, self.device)
        # A refill starts by copying this image of every per-row field at its padding value
        # (token 0, row 0, greedy sampling, no slot), then writes only the plan's live entries.
        self._padding = self.arena.bytes[: self.arena.offsets["input_ids"]].copy()
        f32 = np.float32
        self.processors = _Arena({
            "presence": (f32, R), "frequency": (f32, R), "repetition": (f32, R), "processor_slots": (i32, R),
            "admit_slots": (i32, S), "bias_ids": (i32, S * MAX_BIASED), "bias_values": (f32, S * MAX_BIASED),
            "bias_until": (i32, S * MAX_BIASED),
        }, self.device)
        self._processors_padding = self.processors.bytes.copy()
        self._rows = np.arange(T + max_decode, dtype=np.int32)  # packed row numbers
        self._metadata: OrderedDict[tuple, list[np.ndarray]] = OrderedDict()  # by shape (``_fill_metadata``)
        self._host_views: dict[Bucket, tuple] = {}
        self._inputs: dict[Bucket, StepInputs] = {}

    def _meta_sizes(self, tokens: int) -> dict[str, int]:
        """The entries of each PrefillMetadata array for ``tokens`` rows."""
        S, C = self.max_prefill_seqs, max_chunks_for(tokens, self.max_prefill_seqs, self.chunk_size)
        return dict(cu_seqlens=S + 1, seq_idx=tokens, slot_idx=S, has_initial_state=S, context_lens=S,
                    chunk_seq=C, chunk_start=C, chunk_end=C, seq_chunk_start=S + 1, final_slot=S,
                    snapshot_slot=S, snapshot_row=S)

    def _prefill_meta(self, views: dict, tokens: int, prefix: str = "") -> PrefillMetadata:
        return PrefillMetadata(**{k: views[prefix + k][:n] for k, n in self._meta_sizes(tokens).items()},
                               chunk_size=self.chunk_size)

    def _replay(self, views: dict, bucket: Bucket) -> Replay:
        """``bucket``'s Mamba2 layout (a verify bucket's) over ``views``."""
        E, Tp = layout_rows(bucket.prefill, self.max_prefill_seqs, bucket.drafts), bucket.prefill
        return Replay(self._prefill_meta(views, E, "replay_"), views["replay_src"][:E], views["replay_own"][:Tp],
                      views["replay_record"][:Tp])

    def inputs(self, bucket: Bucket) -> StepInputs:
        """Device inputs shaped for ``bucket``: fixed views into the device arena."""
        if bucket not in self._inputs:
            self._check(bucket)
            d, B, Tp = self.arena.dev, bucket.decode, bucket.prefill
            rows = self.rows(bucket)
            self._inputs[bucket] = StepInputs(
                input_ids=d["input_ids"][: Tp + B],
                prefill=self._prefill_meta(d, Tp) if Tp else None,
                decode_slots=d["decode_slots"][:B],
                decode_kv_lens=d["decode_kv_lens"][:B],
                logit_rows=d["logit_rows"][:rows],
                replay=self._replay(d, bucket) if bucket.drafts and Tp else None,
                row_slots=d["sample_slots"][:rows],
                route_as=d["route_as"][: Tp + B],
            )
        return self._inputs[bucket]

    def rows(self, bucket: Bucket) -> int:
        """Logit rows of ``bucket``: room for every prefill sequence's (one each, 1 + drafts in a
        verify bucket), then one per decode row."""
        return (self.max_prefill_seqs * (1 + bucket.drafts) if bucket.prefill else 0) + bucket.decode

    def sampling(self, bucket: Bucket) -> tuple[torch.Tensor, ...]:
        """Device views (temperature, top_k, top_p, seed, position, sample_slots), each [rows]."""
        n = self.rows(bucket)
        return tuple(self.arena.dev[k][:n] for k in
                     ("temperature", "top_k", "top_p", "seed", "position", "sample_slots"))

    def _check(self, bucket: Bucket) -> None:
        if (bucket.decode > self.max_decode or bucket.prefill > self.max_prefill_tokens
                or bucket.drafts > self.max_drafts):
            raise ValueError(f"{bucket} exceeds the buffers' maxima ({self.max_decode} decode rows, "
                             f"{self.max_prefill_tokens} prefill tokens, {self.max_drafts} drafts)")

    def fill(self, plan: StepPlan, bucket: Bucket) -> None:
        """Write ``plan`` into the host arena, padded to ``bucket``.

        Logit rows come in plan order, live ones first: the last token of each prefill sequence
        (its last ``prefill_logits`` tokens), then each decode row; the rest point at row 0 and
        their logits are ignored. Every entry the
        bucket's inputs read is reset to padding first, so nothing from an earlier, larger step
        (or anything else left there) can reach this one.
        """
        if not bucket.fits(plan.num_decode, plan.num_prefill_tokens, plan.num_prefill, self.max_prefill_seqs,
                           plan.num_drafts):
            raise ValueError(f"plan ({plan.num_decode} decodes, {plan.num_prefill_tokens} prefill tokens in "
                             f"{plan.num_prefill} sequences, {plan.num_drafts} drafts) does not fit {bucket}")
        self._check(bucket)
        # the previous step's copy must have left the host arena before we overwrite it
        self.arena.wait()
        self.arena.bytes[: len(self._padding)] = self._padding
        h, Tp = self.arena.np, bucket.prefill
        n_pre, n_dec = plan.num_prefill_rows, plan.num_decode
        ids = h["input_ids"][: Tp + bucket.decode]
        ids[:] = 0
        ids[Tp : Tp + n_dec] = plan.decode_tokens
        n_tok = len(plan.prefill_tokens)
        route_as = h["route_as"][: Tp + bucket.decode]
        route_as[:] = 0 if n_tok else Tp  # padding: as the first live row
        route_as[:n_tok] = self._rows[:n_tok]
        route_as[Tp : Tp + n_dec] = self._rows[Tp : Tp + n_dec]
        h["decode_slots"][:n_dec] = plan.decode_slots
        np.add(plan.decode_context, 1, out=h["decode_kv_lens"][:n_dec])
        rows = h["logit_rows"]
        rows[n_pre : n_pre + n_dec] = self._rows[Tp : Tp + n_dec]
        if Tp:
            ids[: len(plan.prefill_tokens)] = plan.prefill_tokens
            if not bucket.drafts and len(plan.replay_lens) and plan.replay_lens.any():
                raise ValueError(f"plan replays drafts from the record outside a verify bucket ({bucket})")
            self._fill_metadata(plan, bucket)
            ends = np.cumsum(plan.prefill_lens)
            if len(plan.prefill_logits):  # each sequence's last tokens: ends - n .. ends - 1
                n = plan.prefill_logits
                rows[:n_pre] = np.repeat(ends - n, n) + (np.arange(n_pre) - np.repeat(np.cumsum(n) - n, n))
            else:
                rows[:n_pre] = ends - 1
        if plan.sampled:
            for name in ("temperature", "top_k", "top_p", "seed", "position", "sample_slots"):
                h[name][: plan.num_rows] = getattr(plan, name)
        if plan.processed:
            self._fill_processors(plan)

    def _fill_metadata(self, plan: StepPlan, bucket: Bucket) -> None:
        """The prefill sequences' metadata (and a verify bucket's Mamba2 layout) in the host
        arena: computed, or, for a shape refilled before (a speculating request's verify steps
        repeat a few), copied back as it was computed then, with the one thing that moves, the
        sequences' context, written anew (``METADATA_SHAPES``)."""
        if bucket not in self._host_views:  # the bucket's views of the host arena, which never move
            h = self.arena.np
            meta = self._prefill_meta(h, bucket.prefill)
            replay = self._replay(h, bucket) if bucket.drafts else None
            views = [*meta.arrays().values()]
            if replay is not None:
                views += [*replay.meta.arrays().values(), replay.src, replay.own, replay.record]
            self._host_views[bucket] = meta, replay, views
        meta, replay, views = self._host_views[bucket]
        # everything but the context the metadata is made of (the context only as "has one")
        key = (bucket, *(tuple(a.tolist()) for a in (
            plan.prefill_lens, plan.prefill_slots, plan.prefill_context > 0, plan.snapshot_slots,
            plan.snapshot_tokens, plan.final_slots, plan.prefill_logits, plan.replay_lens)))
        saved = self._metadata.get(key)
        if saved is None:
            fill_prefill_metadata(meta, plan.prefill_lens, plan.prefill_slots, plan.prefill_context > 0,
                                  plan.prefill_context,
                                  (plan.snapshot_slots, plan.snapshot_tokens) if len(plan.snapshot_slots) else None,
                                  plan.final_slots if len(plan.final_slots) else None)
            if replay is not None:
                fill_replay(replay, plan, self.record_stride)
            self._metadata[key] = [v.copy() for v in views]
            if len(self._metadata) > METADATA_SHAPES:
                self._metadata.popitem(last=False)
            return
        self._metadata.move_to_end(key)
        for view, values in zip(views, saved):
            view[:] = values
        n = plan.num_prefill
        meta.context_lens[:n] = plan.prefill_context
        if replay is not None:
            replay.meta.context_lens[:n] = plan.prefill_context

    def _fill_processors(self, plan: StepPlan) -> None:
        """The processors' arena: each row's penalties, and the bias entries of each prefill
        sequence that starts its prompt (the others' slots stay -1: nothing is admitted)."""
        self.processors.wait()
        self.processors.bytes[:] = self._processors_padding
        h, n_pre = self.processors.np, plan.num_prefill
        for name in ("presence", "frequency", "repetition", "processor_slots"):
            h[name][: plan.num_rows] = getattr(plan, name)
        starts = plan.prefill_context == 0
        h["admit_slots"][:n_pre] = np.where(starts, plan.prefill_slots, PAD_SLOT_ID)
        # a sequence that is not admitted writes its entries to the last row, which rows without
        # processors read: only padding may go there
        for name in ("bias_ids", "bias_values", "bias_until"):
            h[name][: n_pre * MAX_BIASED] = np.where(starts[:, None], getattr(plan, name), 0).reshape(-1)

    def processor_inputs(self, bucket: Bucket) -> dict[str, torch.Tensor]:
        """Device views of the processors' arena for ``bucket``: per row presence, frequency,
        repetition, processor_slots [rows]; per prefill sequence admit_slots [S], bias_* [S, MAX_BIASED]."""
        d, n, S = self.processors.dev, self.rows(bucket), self.max_prefill_seqs
        views = {k: d[k][:n] for k in ("presence", "frequency", "repetition", "processor_slots")}
        views["admit_slots"] = d["admit_slots"]
        views.update({k: d[k].view(S, MAX_BIASED) for k in ("bias_ids", "bias_values", "bias_until")})
        return views

    def upload(self) -> None:
        """The step's one host-to-device copy of its inputs (asynchronous on the current stream;
        inside a graph capture, a copy node and an event-record node of the graph)."""
        self.arena.upload()

    def upload_processors(self) -> None:
        """The processed sampling stage's copy of the processors' arena (as ``upload``)."""
        self.processors.upload()
