"""DeepEP V1's module names over moe_ep, whose Buffer takes the same calls: with this folder on sys.path
the DeepEP peer's rank functions (moe_ep/bench/deepep_peer.py) run on CPU ranks, where DeepEP cannot."""
from moe_ep import Buffer, Config, topk_idx_t  # noqa: F401
