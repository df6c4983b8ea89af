"""The catalogue's second half (exactness.suite.catalogue): the C kernels' bugs (cpu_vnni.c,
the span kernel, cpu_amx.c), inputs the suite did not generate, the streamed loader's, and the
grouped MoE kernels'."""

from __future__ import annotations

from .. import formats, kimi, moe, quantize
from ..kernels.cpu import gemm, vnni_layout
from ..kernels.triton import grouped as triton_grouped
from .targets import (
    ACT32_KERNELS,
    AMX,
    AMX_KERNEL,
    AMX_SPANS_TWIN,
    AMX_VECTORS,
    BATCH,
    C_KERNEL,
    CPU,
    CPU_VECTORS,
    DEVICES_MOE,
    GROUPED_KERNEL,
    SPANS,
    SPANS_CHAIN,
    SPANS_EDGE,
    SPANS_VECTORS,
    Mutant,
    at,
    grouped,
    moe_block,
    triton_at,
)

C_AND_MOE = (
    # --- the C kernel (cpu_vnni.c), the CPU path's production code
    Mutant("vnni-high-limb-correction-unscaled", C_KERNEL, "limbs == 1 ? 7 : 15", "7",
           "the bias correction of the high limb not scaled by 256 (per-limb zero points)",
           (CPU, CPU_VECTORS)),
    Mutant("vnni-high-nibble-leaks-neighbour", C_KERNEL,
           "_mm512_and_si512(_mm512_srli_epi16(pair, 4), low4)", "_mm512_srli_epi16(pair, 4)",
           "a 16-bit shift unpacks the high nibble with the next byte's bits in it",
           (CPU, CPU_VECTORS)),
    Mutant("vnni-tail-row-dropped", C_KERNEL, "case 3: CALL(3, __VA_ARGS__); break;",
           "case 3: CALL(2, __VA_ARGS__); break;",
           "the last row of a batch whose size leaves 3 rows over never computed",
           (CPU, CPU_VECTORS)),
    Mutant("vnni-activations-truncated", C_KERNEL, "_MM_FROUND_TO_NEAREST_INT",
           "_MM_FROUND_TO_ZERO", "activations quantized by truncation instead of RNE",
           (CPU, CPU_VECTORS)),
    Mutant("vnni-row-exponent-too-small", C_KERNEL, "ae + t0 + !fits", "ae + t0",
           "the activation exponent one too small where the row maximum needs the next one",
           (CPU, CPU_VECTORS)),
    Mutant("vnni-row-scale-from-the-batch", C_KERNEL,
           "for (int64_t k = r * K; k < (r + 1) * K; k++) {",
           "for (int64_t k = 0; k < M * K; k++) {",
           "one activation scale for the whole batch, in C", (CPU, BATCH)),
    Mutant("vnni-one-call-high-limb-is-the-low", C_KERNEL,
           "grouped_tiles(gr, words, planes, M * K, limbs,",
           "grouped_tiles(gr, words, planes, 0, limbs,",
           "the one-call path (exact_grouped) reads every limb from the low limb's plane",
           (CPU, CPU_VECTORS)),
    # the C kernel at 32-bit activations: four limbs, P in two int32 halves, an int64 term
    Mutant("vnni-32-lowest-limb-dropped", C_KERNEL,
           "p_lo = _mm512_add_epi32(_mm512_slli_epi32(d[1], 8), d[0]);",
           "p_lo = _mm512_slli_epi32(d[1], 8);",
           "the lowest of four activation limbs never added (a limb dropped)",
           (CPU_VECTORS, CPU, ACT32_KERNELS + "[vnni-limbs]")),
    Mutant("vnni-32-high-half-place-off", C_KERNEL,
           "_mm512_slli_epi64(_mm512_mul_epi32(p_hi, c), 16)",
           "_mm512_slli_epi64(_mm512_mul_epi32(p_hi, c), 8)",
           "the high pair of limbs at 2**8, not 2**16: a limb's place value off by one",
           (CPU_VECTORS, CPU, ACT32_KERNELS + "[vnni-limbs]")),
    Mutant("vnni-32-group-sum-in-int32", C_KERNEL,
           """    return _mm512_add_epi64(_mm512_slli_epi64(_mm512_mul_epi32(p_hi, c), 16),
                            _mm512_mul_epi32(p_lo, c));""",
           "    return _mm512_mul_epi32(_mm512_add_epi32(_mm512_slli_epi32(p_hi, 16), p_lo), c);",
           "a group's P = 2**16 * P_hi + P_lo summed in int32, where 32-bit activations need "
           "int64: it wraps", (CPU_VECTORS, CPU, ACT32_KERNELS + "[vnni-limbs]")),
    Mutant("vnni-rounding-ties-up", C_KERNEL, "_mm512_cmpeq_epi64_mask(rem, half) & odd;",
           "_mm512_cmpeq_epi64_mask(rem, half);",
           "the final rounding's ties away from zero instead of to even",
           ("tests/test_modules.py::test_final_rounding_near_ties[vnni-limbs]", CPU,
            DEVICES_MOE)),
    Mutant("vnni-normal-rounding-ties-down", C_KERNEL,
           "_mm512_add_epi64(_mm512_add_epi64(a, below_half), last_kept)",
           "_mm512_add_epi64(a, below_half)",
           "the final rounding's fast path (normal results) breaks ties toward zero, not to even",
           ("tests/test_modules.py::test_final_rounding_near_ties[vnni-limbs]", CPU)),
    Mutant("vnni-normal-rounding-past-the-largest-binade", C_KERNEL,
           "_mm512_cmplt_epi64_mask(field, _mm512_set1_epi64(emax - 1))",
           "_mm512_cmplt_epi64_mask(field, _mm512_set1_epi64(emax + 1))",
           "the final rounding's fast path taken for results past the largest finite binade "
           "(NaN and garbage patterns where infinity is due)",
           ("tests/test_modules.py::test_final_rounding_at_the_top_of_the_range",)),
    Mutant("vnni-subnormal-output-flushed", C_KERNEL,
           "bits = _mm512_mask_mov_epi64(bits, subnormal, n);",
           "bits = _mm512_maskz_mov_epi64(~subnormal, bits);",
           "subnormal results flushed to zero (FTZ)", (CPU_VECTORS, CPU)),
    # --- the span kernel (16-bit activations, 4-bit weights)
    Mutant("span-bound-doubled", C_KERNEL,
           "/ d <= SPAN_SIZE_LIMIT &&", "/ d <= 2 * SPAN_SIZE_LIMIT &&",
           "a span's int32 bound off by a factor of two: two extreme groups share a span and wrap",
           (SPANS_EDGE, SPANS_CHAIN + "[one-step-past-k1-k3]")),
    Mutant("span-base-shift-dropped", C_KERNEL,
           "_mm512_srav_epi64(_mm512_slli_epi64(d, 32), r_even)",
           "_mm512_srai_epi64(_mm512_slli_epi64(d, 32), 32)",
           "a span's sum added without its power of two (the even rows' scale exponent lost)",
           (SPANS, SPANS_VECTORS)),
    Mutant("span-chain-bound-doubled", C_KERNEL,
           "a * lanes_chain[l] <= SPAN_SIZE_LIMIT", "a * lanes_chain[l] <= 2 * SPAN_SIZE_LIMIT",
           "an unshifted block's chain bound off by a factor of two: a chain wraps",
           (SPANS_EDGE, SPANS_CHAIN + "[one-step-past-k0-k2]")),
    Mutant("span-unshifted-biases-kept", C_KERNEL,
           "_mm512_slli_epi64(_mm512_add_epi64(odd[i], groups), 32)",
           "_mm512_slli_epi64(odd[i], 32)",
           "an unshifted block's even rows keep the 2 G biases of 2**31 of their chains",
           (SPANS_EDGE, SPANS)),
    Mutant("span-pending-rows-lost", C_KERNEL,
           "for (int i = K / 32; i < before; i++) finish_pending(p, i, Np);",
           "for (int i = K / 32; i < 0; i++) finish_pending(p, i, Np);",
           "with fewer groups than tile rows, the previous tile's last rows never rounded out",
           (SPANS, "tests/test_modules.py::test_rows_agree_across_the_kernel_switch")),
    Mutant("span-second-sum-not-reset", C_KERNEL,
           "                d0[i] = d1[i] = _mm512_setzero_si512();",
           "                d0[i] = _mm512_setzero_si512();",
           "one of a row's two partial sums carried into the next span",
           (SPANS, SPANS_VECTORS)),
    # --- the AMX kernel (cpu_amx.c): its tiles emulated where the CPU has none
    Mutant("amx-tile-stride-wrong", AMX_KERNEL, "_tile_loadd(4, at, K);",
           "_tile_loadd(4, at, AMX_STEP_K);",
           "the activation tile loaded with a stride of one step, not of a row: every row after "
           "the first reads its neighbour's bytes", (AMX, AMX_VECTORS)),
    Mutant("amx-high-digit-unsigned", AMX_KERNEL, "_tile_dpbusd(1, 4, 7);",
           "_tile_dpbuud(1, 4, 7);",
           "the low limb's high-digit dot reads the s8 digit as u8: a negative folded weight "
           "counts 256 too much there", (AMX, AMX_VECTORS)),
    Mutant("amx-span-base-dropped", AMX_KERNEL, "_mm512_sllv_epi64(even, b_even)", "even",
           "a span's dots combined without its base: rows 0..7 of a block whose factors share a "
           "power of two come out that power too small", (AMX, AMX_VECTORS)),
    Mutant("amx-split-step-lost", AMX_KERNEL, "if (!pair && g + 1 < G) {",
           "if (!pair && g + 1 < G && 0) {",
           "where a span ends after the first group of a step, the second group is never taken",
           (AMX, AMX_VECTORS)),
    Mutant("amx-span-cap-ignored", AMX_KERNEL, "int fits = g > 0 && length < AMX_SPAN_GROUPS;",
           "int fits = g > 0;",
           "spans longer than AMX_SPAN_GROUPS groups: past the proved bound, an int32 tile sum "
           "could wrap", (AMX_SPANS_TWIN,)),
    Mutant("amx-span-base-not-spread", AMX_KERNEL,
           "at_span_ends(base, ends, G);", "(void)0;",
           "each group folded by the base of its span so far, not of the whole span: a factor "
           "shifted by more than the span's base loses bits", (AMX_SPANS_TWIN, AMX)),
    Mutant("amx-in-place-order-lost", AMX_KERNEL, "L->packed && L->bits == 4);", "0);",
           "the activations in natural order against 4-bit words read in place, whose nibbles "
           "hold the k of each 8 in the order 0, 2, 4, 6, 1, 3, 5, 7", (AMX, AMX_VECTORS)),
    # --- inputs the suite did not generate (issue 23)
    Mutant("int-mm-exactness-trusted", at(gemm._GemmKernel.available),
           "if self.int8 and not int_mm_exact():", "if False:",
           "torch._int_mm trusted without the check of its exactness: on a CPU whose int8 GEMM "
           "runs through fp32, wrong sums",
           ("tests/test_modules.py::test_every_cpu_path_the_plan_takes_on_another_machine"
            "[no-vnni-int-mm-inexact]",)),
    Mutant("subnormal-scale-not-on-the-subnormal-grid", at(quantize.quantize_weight),
           "es = np.maximum(es, BFLOAT16.quantum_min)", "es = es + 0",
           "from_weight's scale exponent left below bf16's smallest: a tiny group's scale "
           "encoded as a subnormal of another value",
           ("tests/test_modules.py::test_from_weight_matches_the_oracle_quantizer",)),
    Mutant("converter-keeps-a-layer-of-other-act-bits", at(kimi.convert._stage),
           "reuse = isinstance(module, PackedInt4Linear) and module.act_bits == act_bits",
           "reuse = isinstance(module, PackedInt4Linear)",
           "convert_kimi_to_exact keeps the model's exact layers at their act_bits, not the one "
           "asked for", ("tests/test_kimi.py::test_every_conversion_option_computes_at_its_"
                         "setting[None-8]",
                         "tests/test_kimi.py::test_every_conversion_option_computes_at_its_"
                         "setting[4-4]")),
    Mutant("converter-checks-only-the-first-projection", at(kimi.routed_reads),
           "for name, layer in targets.items():  # all header checks before the first byte",
           "for name, layer in list(targets.items())[:1]:  # all header checks before the "
           "first byte",
           "the loader checks the first projection's header entries alone: a tensor of "
           "another shape further on is installed as it is, and read out of bounds",
           ("tests/test_kimi.py::test_bad_tensors_name_the_tensor_and_the_file"
            "[packed-too-short]",
            "tests/test_kimi.py::test_bad_tensors_name_the_tensor_and_the_file[packed-int64]")),
    # --- the streamed loader (issue 42)
    Mutant("loader-values-unchecked", at(kimi.routed_reads),
           "checkpoint.check_values(targets[name], name, buffer, tensor)", "pass",
           "the streamed tensors' values never checked: a non-finite scale loads silently",
           ("tests/test_load.py::test_a_failure_midway_through_the_stream_leaves_the_model_"
            "unchanged",
            "tests/test_kimi.py::test_bad_tensors_name_the_tensor_and_the_file[scale-nan]")),
    Mutant("loader-keeps-every-shard-mapped", at(kimi.KimiCheckpoint.stream),
           "if last and not mapped:", "if last and False:",
           "each shard's mapping kept to the end of the load: the process holds the whole "
           "checkpoint's pages on top of the copies",
           ("tests/test_load.py::test_each_scale_is_checked_once_and_each_shard_released_after_"
            "its_last_tensor",)),
    Mutant("loader-size-not-looked-at-again", at(kimi.KimiCheckpoint.map_tensor),
           "if size != shard.size:", "if False:",
           "a shard cut short after its header was read is read through its mapping: a SIGBUS "
           "where the pages are gone",
           ("tests/test_load.py::test_a_shard_cut_short_under_the_reader_is_an_error_not_a_"
            "crash",)),
    Mutant("mmap-copies-the-tensors", at(kimi.KimiCheckpoint.read),
           "if mapped and view.data_ptr() % view.element_size() == 0:", "if False:",
           "mmap=True copies every tensor: anonymous memory the size of the experts",
           ("tests/test_load.py::test_mmap_leaves_the_int4_tensors_file_backed_and_copy_on_"
            "write",)),
    Mutant("finite-check-first-step-only", at(formats.check_finite_tensor),
           "flat.split(CHECK_STEP) if", "flat.split(CHECK_STEP)[:1] if",
           "a CPU check in steps that stops after the first: a non-finite scale past it loads",
           ("tests/test_formats.py::test_a_finite_check_in_steps_finds_a_bad_value_at_every_"
            "step_edge[inf-131076]",)),
    Mutant("remote-expert-computes-zeros", at(moe.RemoteLinear.forward),
           "raise MissingExpertError(", "return x.new_zeros(x.shape[0], self.out_features)\n"
           "    MissingExpertError(",
           "a token routed to an expert held elsewhere gets zeros, silently",
           ("tests/test_load.py::test_a_rank_loads_its_experts_and_refuses_tokens_for_the_"
            "others[copied-per-expert]",
            "tests/test_load.py::test_a_predicate_takes_any_subset_and_the_fused_layout_too[k2]")),
    Mutant("span-chain-bound-of-the-first-chain", C_KERNEL,
           "_mm512_max_epi32(chain0, chain1)", "chain0",
           "an unshifted block certified on one of its two chains: the other wraps",
           (SPANS_CHAIN + "[one-step-past-k1-k3]",)),  # weak by design: the other three pass
    Mutant("nibble-layout-past-four-bits", at(vnni_layout.NativeWeights.__init__),
           "q8.max() <= 7", "q8.max() <= 8",
           "the C kernel's nibble layout taken for weights one past 4 bits: an 8 spills into "
           "its neighbour's nibble",
           ("tests/test_modules.py::test_the_c_layout_chosen_from_the_weights_range_at_its_"
            "edges[8]",)),
    # --- the grouped MoE kernels (issue 22)
    Mutant("grouped-neighbouring-experts-weights", C_KERNEL,
           "const Layer *L = gr->layers[e * gr->parts + p];",
           "const Layer *L = gr->layers[(e + 1) % gr->experts * gr->parts + p];",
           "the tokens routed to one expert run through the neighbouring expert's weights",
           (grouped("vnni-grouped"), moe_block("cpu"))),
    Mutant("grouped-expert-stride-off-by-one", C_KERNEL,
           "const Layer *L = gr->layers[e * gr->parts + p];",
           "const Layer *L = gr->layers[e * (gr->parts - 1) + p];",
           "the expert stride of the table of (expert, part) layers off by one",
           (grouped("vnni-grouped"), moe_block("cpu"))),
    Mutant("grouped-blocks-of-the-neighbouring-expert", triton_at(triton_grouped, "blocks"),
           "torch.searchsorted(ends, block, right=True)",
           "torch.searchsorted(ends, block, right=False)",
           "the GPU schedule's block of an expert's rows given the expert before it: its rows "
           "never computed", (grouped("triton-grouped"), moe_block("triton"))),
    Mutant("grouped-last-blocks-padding-stored-as-a-token", GROUPED_KERNEL,
           "out = valid[:, None] & mask_n[None, :]", "out = (rows >= 0)[:, None] & mask_n[None, :]",
           "the padding of an expert's last block of rows read as a token and stored over a "
           "routed row", (grouped("triton-grouped"), moe_block("triton"))),
    Mutant("grouped-table-stride-off-by-one", triton_at(triton_grouped, "block_layer"),
           "entry = table_ptr + (expert * PARTS + part) * 4",
           "entry = table_ptr + (expert * (PARTS - 1) + part) * 4",
           "the expert stride of the GPU's table of layers off by one: another expert's (or "
           "part's) weights", (grouped("triton-grouped"), moe_block("triton"))),
    Mutant("grouped-row-sent-to-the-wrong-token", at(moe.weighted_sum),
           "row_of[routing.pair] = torch.arange(pairs, device=rows.device)",
           "row_of = routing.pair.clone()",
           "the routing's permutation taken for its inverse: a row's result summed into the "
           "wrong token", (moe_block("cpu"), "tests/test_moe.py::"
                           "test_kimi_moe_grouped_matches_its_per_expert_loop[cpu]")),
)
