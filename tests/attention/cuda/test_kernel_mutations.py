"""Mutation matrix: plant one bug per copy of kernels/cuda/paged_attention.cu and show the checks catch it.

Each mutation is a literal string replacement on the real source (asserted to apply exactly as
often as stated), so this file documents exactly what changed. All mutants are compiled into ONE
emulator module, each copy wrapped in its own namespace (one g++ run instead of one per mutant),
next to an unmutated control copy that must pass the same checks.

A mutant counts as caught when, on either schedule we run it under, the output is wrong
(non-finite or beyond the dtype's tolerance vs the float64 reference) or the launch raises an
emulator error (EmuDeadlockError for divergent collectives). `caught_by` records, per schedule,
what each one is expected to trip, so a weakened check shows up as a failing test. Mutants of the
sliding window and soft-capping run on windowed cases whose keys below each window are NaN (an
off-by-one that reads one key too many reads a NaN); those of the attention sinks on cases with a sink
per head about the logits' size (SINKS), v2's with sequences of one partition and of several.
"""
from __future__ import annotations

import functools
import re
from dataclasses import dataclass

import numpy as np
import pytest
import test_kernels as T  # noqa: E402  (helpers: make_case, run_case, reference, tolerances)

from pagedrun.attention.cuda import kernels as K  # noqa: E402

# Thread groups of 2 lanes (the group shuffle is live); 4 query heads over 2 KV heads launch the
# grouped kernel (2 query heads per block), whose loops over the group the mutants then run through.
VARIANT = K.KernelVariant("float16", 64, 16, "auto", 2)
V1_SEQ_LENS = [1, 16, 35, 47, 20]  # 1, an exact block multiple, partial last blocks
V2_SEQ_LENS = [1, 513, 1200, 700]  # several 512-token partitions
# Under a window of 20 keys (block 16): W - 1, W, W + 1 keys, the window's first key on a block
# boundary (36: key 16) and one either side; under 600: the first key inside, on (1624: key 1024) and
# below a partition boundary, so v2 launches 3 of the sequence's 4 partitions.
WINDOW_V1_SEQ_LENS = [19, 20, 21, 35, 36, 37, 1, 70]
WINDOW_V2_SEQ_LENS = [1537, 1624, 1200, 601, 3]
SINKS = np.array([1.5, -0.5, 2.5, 0.75], np.float32)  # GPT-OSS's learned sinks, one per query head


@dataclass(frozen=True)
class Mutation:
    id: str
    what: str
    old: str
    new: str
    count: int  # occurrences of `old` in the source (all are replaced)
    version: str  # "v1" or "v2": the launch that exercises it
    caught_by: tuple[tuple[str, str], ...]  # (schedule, "wrong" | "deadlock" | "missed")
    window: int = 0  # the launch's sliding window (its case: WINDOW_*_SEQ_LENS, placeholders NaN)
    softcap: float = 0.0
    sinks: bool = False  # the launch takes SINKS


MUTATIONS = [
    Mutation(
        "missing_barrier_q",
        "no __syncthreads between writing q to shared memory and the QK loop reading it",
        "for (int e = 0; e < Q_VEC_SIZE; e++) q_smem[i * Q_VEC_SIZE + e] = to_float(qv.v[e]);\n  }\n  __syncthreads();\n",
        "for (int e = 0; e < Q_VEC_SIZE; e++) q_smem[i * Q_VEC_SIZE + e] = to_float(qv.v[e]);\n  }\n",
        1, "v1", (("round_robin", "wrong"), ("greedy", "wrong")),
    ),
    Mutation(
        "missing_barrier_before_pv",
        "no __syncthreads between normalising the logits and the PV loop reading other threads' logits",
        "logits[g * logits_stride + i] *= inv_sum;\n    }\n  }\n  __syncthreads();\n",
        "logits[g * logits_stride + i] *= inv_sum;\n    }\n  }\n",
        1, "v1", (("round_robin", "wrong"), ("greedy", "wrong")),
    ),
    Mutation(
        "missing_barrier_smem_reuse",
        "no __syncthreads before the output reduction overwrites the logits other warps still read",
        "the logits are dead once every warp is past PV.\n  __syncthreads();\n",
        "the logits are dead once every warp is past PV.\n",
        1, "v1", (("round_robin", "missed"), ("greedy", "wrong")),
    ),
    Mutation(
        "missing_barrier_out_smem",
        "no __syncthreads between the warps' out_smem writes and the cross-warp sum",
        "  __syncthreads();\n  for (int i = thread_idx; i < GROUP * HEAD_SIZE; i += NUM_THREADS) {",
        "  for (int i = thread_idx; i < GROUP * HEAD_SIZE; i += NUM_THREADS) {",
        1, "v1", (("round_robin", "wrong"), ("greedy", "wrong")),
    ),
    Mutation(
        "block_table_ignored",
        "wrong block-table index: the logical block number used as the physical one",
        "const long long physical_block_number = block_table[block_idx];",
        "const long long physical_block_number = block_idx;",
        2, "v1", (("round_robin", "wrong"), ("greedy", "wrong")),
    ),
    Mutation(
        "block_table_partition_relative",
        "wrong block-table index: v2 indexes the table relative to its partition's first block",
        "const long long physical_block_number = block_table[block_idx];",
        "const long long physical_block_number = block_table[block_idx - start_block_idx];",
        2, "v2", (("round_robin", "wrong"), ("greedy", "wrong")),
    ),
    Mutation(
        "gqa_head_mapping",
        "query head -> kv head by modulo instead of division",
        "const int kv_head_idx = head0 / num_queries_per_kv;",
        "const int kv_head_idx = head0 % num_kv_heads;",
        1, "v1", (("round_robin", "wrong"), ("greedy", "wrong")),
    ),
    Mutation(
        "last_block_dropped",
        "off-by-one in the last block: block count rounded down, the partial last block is skipped",
        "const int num_seq_blocks = PR_DIV_UP(seq_len, BLOCK_SIZE);",
        "const int num_seq_blocks = seq_len / BLOCK_SIZE;",
        1, "v1", (("round_robin", "wrong"), ("greedy", "wrong")),
    ),
    Mutation(
        "v_read_past_end",
        "off-by-one in the last block: PV reads the value row one past seq_len (0 * NaN)",
        "const bool valid = t < BLOCK_SIZE && (unsigned)(token_idx - first_key) < (unsigned)(seq_len - first_key);",
        "const bool valid = t < BLOCK_SIZE && (unsigned)(token_idx - first_key) <= (unsigned)(seq_len - first_key);",
        1, "v1", (("round_robin", "wrong"), ("greedy", "wrong")),
    ),
    Mutation(
        "divergent_shuffle",
        "divergent shuffle: only lanes 0-15 take part in the exp-sum warp reduction",
        "      v[n] += __shfl_xor_sync(PR_FULL_MASK, v[n], mask);\n    }\n    if (lane == 0)",
        "      if (lane < 16) v[n] += __shfl_xor_sync(PR_FULL_MASK, v[n], mask);\n    }\n    if (lane == 0)",
        1, "v1", (("round_robin", "deadlock"), ("greedy", "deadlock")),
    ),
    Mutation(
        "v2_no_rescale",
        "v2 reduce sums partition exp-sums without rescaling by exp(m_i - M)",
        "const float w = exp_sums_ptr[i] * pagedrun::fast_exp(shared_max_logits[i] - max_logit);",
        "const float w = exp_sums_ptr[i];",
        1, "v2", (("round_robin", "wrong"), ("greedy", "wrong")),
    ),
    Mutation(
        "window_one_key_short",
        "off-by-one in the window: the query sees W - 1 keys (the window's first key dropped)",
        "return window > 0 && seq_len > window ? seq_len - window : 0;",
        "return window > 0 && seq_len > window ? seq_len - window + 1 : 0;",
        1, "v1", (("round_robin", "wrong"), ("greedy", "wrong")), window=20,
    ),
    Mutation(
        "window_one_key_long",
        "off-by-one in the window: the query sees W + 1 keys (one below the window, NaN in a placeholder)",
        "return window > 0 && seq_len > window ? seq_len - window : 0;",
        "return window > 0 && seq_len > window ? seq_len - window - 1 : 0;",
        1, "v2", (("round_robin", "wrong"), ("greedy", "wrong")), window=600,
    ),
    Mutation(
        "window_mask_dropped_in_pv",
        "the first block's values below the window are summed (weight 0, but 0 * NaN)",
        "const bool valid = t < BLOCK_SIZE && (unsigned)(token_idx - first_key) < (unsigned)(seq_len - first_key);",
        "const bool valid = t < BLOCK_SIZE && token_idx < seq_len;",
        1, "v1", (("round_robin", "wrong"), ("greedy", "wrong")), window=20,
    ),
    Mutation(
        "window_partitions_from_zero",
        "v2's grid partitions counted from position 0, not from the window's first: the window's end is missed",
        "(first_key / pr_max(PARTITION_SIZE, 1) + partition_idx) * BLOCKS_PER_PARTITION",
        "partition_idx * BLOCKS_PER_PARTITION",
        1, "v2", (("round_robin", "wrong"), ("greedy", "wrong")), window=600,
    ),
    Mutation(
        "softcap_ignored",
        "logit soft-capping never applied",
        "return cap > 0.f ? cap * tanhf(logit / cap) : logit;",
        "return logit;",
        1, "v1", (("round_robin", "wrong"), ("greedy", "wrong")), window=20, softcap=2.0,
    ),
    Mutation(
        "sink_dropped_v1",
        "v1 never adds the sink's exp to the exp-sum (the sink's max alone stays)",
        "for (int g = 0; g < GROUP; g++) exp_sum[g] += fast_exp(sinks[head0 + g] - qk_max[g]);",
        "for (int g = 0; g < GROUP; g++) exp_sum[g] += 0.f;",
        1, "v1", (("round_robin", "wrong"), ("greedy", "wrong")), sinks=True,
    ),
    Mutation(
        "sink_per_partition",
        "v2's reduce counts the sink once per partition, as partitions that each added it would",
        "global_exp_sum += pagedrun::fast_exp(sinks[head_idx] - max_logit);",
        "global_exp_sum += num_partitions * pagedrun::fast_exp(sinks[head_idx] - max_logit);",
        1, "v2", (("round_robin", "wrong"), ("greedy", "wrong")), sinks=True,
    ),
    Mutation(
        "sink_skipped_by_one_partition_shortcut",
        "the reduce copies a one-partition row as it is, sink or not",
        "if (num_partitions == 1 && sinks == nullptr) {",
        "if (num_partitions == 1) {",
        1, "v2", (("round_robin", "wrong"), ("greedy", "wrong")), sinks=True,
    ),
]
CONTROL = Mutation("control", "unmutated source", "", "", 0, "v1", ())


def mutated_source(m: Mutation) -> str:
    src = K.load_source(K.ATTENTION_SOURCE)
    if m is CONTROL:
        return src
    found = src.count(m.old)
    assert found == m.count, f"{m.id}: expected {m.count} occurrence(s) of the planted text, found {found}"
    out = src.replace(m.old, m.new)
    assert out != src
    return out


def combined_source(mutations: list[Mutation]) -> str:
    """Every mutant in its own namespace; the headers once at the top."""
    parts = ["#include <cuda_fp16.h>\n#include <cuda_bf16.h>\n"]
    for m in mutations:
        body = re.sub(r"^#include <[^>]+>\n", "", mutated_source(m), flags=re.M)
        parts.append(f"namespace {m.id} {{\n{body}\n}}  // namespace {m.id}\n")
    return "".join(parts)


def names_for(m: Mutation, version: str | None = None) -> list[str]:
    version = version or m.version
    names = [VARIANT.attention_name(version, VARIANT.group)] + ([VARIANT.reduce_name] if version == "v2" else [])
    # the grouped names spell pagedrun::KvCacheDtype, which lives in each mutant's namespace here
    return [f"{m.id}::{n}".replace("pagedrun::", f"{m.id}::pagedrun::") for n in names]


@functools.lru_cache(maxsize=None)
def mutant_module(schedule: str):
    from pagedrun.build.cudaemu import EmuModule

    everything = [CONTROL, *MUTATIONS]
    names = [n for m in everything for n in names_for(m)]
    control_v2 = names_for(CONTROL, "v2")
    return EmuModule(
        combined_source(everything), name_expressions=names + control_v2, schedule=schedule,
        filename="kernels/cuda/paged_attention.cu (mutants)",
    )


class _Prefixed:
    """Presents the namespaced kernels under their plain names to PagedKernels."""

    def __init__(self, module, prefix: str):
        self.module, self.prefix = module, prefix

    def get_function(self, name: str):
        return self.module.get_function(f"{self.prefix}::{name}".replace("pagedrun::", f"{self.prefix}::pagedrun::"))


def outcome(m: Mutation, schedule: str, version: str) -> str:
    """'ok' | 'wrong' | 'deadlock' | 'error' for mutant m (or the control) under schedule."""
    from pagedrun.build.cudaemu import EmuDeadlockError, EmuError

    ker = K.PagedKernels(VARIANT, _Prefixed(mutant_module(schedule), m.id), np)
    if m.window:
        lens = WINDOW_V1_SEQ_LENS if version == "v1" else WINDOW_V2_SEQ_LENS
        case = T.poison_below_window(T.make_case(VARIANT, lens, 4, 2, seed=22), m.window)
    else:
        case = T.make_case(VARIANT, V1_SEQ_LENS if version == "v1" else V2_SEQ_LENS, 4, 2, seed=21)
    sinks = SINKS if m.sinks else None
    try:
        out, _ = T.run_case(ker, case, version, m.window, m.softcap, sinks)
    except EmuDeadlockError:
        return "deadlock"
    except EmuError:
        return "error"
    ref = case.reference(m.window, m.softcap, sinks)
    ok = np.isfinite(out).all() and T.rel_err(out, ref) <= T.TOL[VARIANT.dtype]
    return "ok" if ok else "wrong"


@pytest.fixture(scope="module")
def emulator():
    T.emulator_or_skip()
    mutant_module("round_robin")  # the one build (the greedy module is the same library, cached)


@pytest.mark.parametrize("schedule", ["round_robin", "greedy"])
@pytest.mark.parametrize("version", ["v1", "v2"])
@pytest.mark.slow
def test_control_passes(emulator, schedule, version):
    assert outcome(CONTROL, schedule, version) == "ok"


@pytest.mark.parametrize("version", ["v1", "v2"])
def test_control_passes_the_window_cases(emulator, version):
    """The unmutated kernels pass every window / softcap case a mutant below is run on."""
    for window, softcap in dict.fromkeys((m.window, m.softcap) for m in MUTATIONS if m.window and m.version == version):
        control = Mutation("control", "", "", "", 0, version, (), window, softcap)
        assert outcome(control, "round_robin", version) == "ok", (window, softcap)


@pytest.mark.parametrize("version", ["v1", "v2"])
def test_control_passes_the_sink_cases(emulator, version):
    control = Mutation("control", "", "", "", 0, version, (), sinks=True)
    assert outcome(control, "round_robin", version) == "ok"


@pytest.mark.parametrize("m", MUTATIONS, ids=[m.id for m in MUTATIONS])
def test_mutant_is_caught(emulator, m):
    seen = {schedule: outcome(m, schedule, m.version) for schedule, _ in m.caught_by}
    expected = {schedule: kind for schedule, kind in m.caught_by}
    assert seen == {s: ("ok" if k == "missed" else k) for s, k in expected.items()}, (
        f"{m.id} ({m.what}): got {seen}, documented {expected}"
    )
    assert any(k != "ok" for k in seen.values()), f"{m.id} escaped every schedule"


def test_every_mutation_applies_once_per_stated_site():
    for m in MUTATIONS:
        mutated_source(m)  # asserts the count
    assert len({m.id for m in MUTATIONS}) == len(MUTATIONS)
