"""Triton kernels for Mamba2 and attention layers, one module per op.

Each module reads top-down: the ``@triton.jit`` kernels, the plain fp32 torch reference
(``<op>_ref``), then the public op, whose body is the Triton launcher: ``kernels.dispatch`` routes
CPU tensors to the reference (``op.triton`` and ``op.reference`` reach either one directly). Ops
take preallocated ``out=`` buffers, never sync with the host, and skip rows whose slot index is
``PAD_SLOT_ID`` (see ``varlen``).
"""

if __name__ == "kernels":
    # Imported by the bare name: the checkout's root is on sys.path and this folder shadows HF's
    # `kernels` package (see _bare_name); the installed package takes the name.
    from ._bare_name import hand_over

    hand_over()
else:
    from .activation import relu2
    from .attention import decode_attention, prefill_attention
    from .conv1d import conv1d_update, conv1d_varlen
    from .decode_linear import ConvTail, gated_norm_linear, norm_linear
    from .embedding import embed_rows
    from .norm import gated_rms_norm, rms_norm
    from .sample import sample
    from .ssd import SSDWorkspace, ssd_scan
    from .state_update import selective_state_update
    from .varlen import PAD_SLOT_ID, PrefillMetadata, fill_prefill_metadata, max_chunks_for

__all__ = [
    "PAD_SLOT_ID", "PrefillMetadata", "fill_prefill_metadata", "max_chunks_for",
    "conv1d_update", "conv1d_varlen", "selective_state_update", "ssd_scan", "SSDWorkspace",
    "decode_attention", "prefill_attention", "rms_norm", "gated_rms_norm", "relu2",
    "norm_linear", "gated_norm_linear", "ConvTail", "embed_rows", "sample",
]
