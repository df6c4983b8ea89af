"""The proofs are tied to the code: they prove what it does, refute what it must not do, and the
real code never exceeds what they prove."""

import json
from unittest import mock

import numpy as np
import pytest
import torch
from hypothesis import given, target
from hypothesis import strategies as st

from exactness import dataflow
from exactness.contract import BFLOAT16, FLOAT32, group_dot_bound
from exactness.suite.counterexamples import read
from exactness.suite.mutants.run import CATALOGUE, Mutant, applied, mutated_function
from exactness.suite.paths import run
from exactness.suite.reference import combine_groups, group_dots, quantize_activations, split_scales
from exactness.suite.strategies import (
    INT8_KERNEL_ACT_BITS,
    activation_bits,
    formats,
    int_weights,
    scale_bits,
)
from proofs import (
    activations,
    combine,
    dots,
    dots_amx,
    dots_avx2,
    dots_spans,
    gemms,
    prover,
    rounding,
)
from proofs import obligations as ob
from proofs.prover import extreme_case, main, prove, prove_once

pytestmark = pytest.mark.stage("reference")  # make verify's stage


def verdicts(capsys, *argv):
    """The CLI's verdicts, through its cache (a query's verdict, keyed by its text and Z3's
    version, is proved once a checkout; the thorough profile's proofs stage proves afresh)."""
    code = main(["--json", "--jobs", "1", *argv])
    return code, {v["name"]: v for v in json.loads(capsys.readouterr().out)}


def test_kimi_config_proves(capsys):
    code, got = verdicts(capsys, "--w-bits", "4", "--a-bits", "16", "--k", "7168",
                         "--no-rounding")
    assert code == 0 and all(v["verdict"] == "proved" for v in got.values())
    assert {"limb-split-a16", "group-dot-w4-a16", "group-recombine-w4-a16",
            "combine-w4-a16-k7168", "cpu-int-mm-k7168", "cpu-combine-w4-a16-k7168"} <= set(got)
    v = got["combine-w4-a16-k7168"]
    assert {"name", "w_bits", "a_bits", "k", "acc_bits", "verdict", "seconds",
            "counterexample"} <= set(v) and v["acc_bits"] == 64


def test_every_obligation_has_a_recorded_proof():
    """A fresh clone proves again only what changed since the recorded proofs; an obligation
    changed without `--record` would make every ci-profile verify prove it afresh."""
    missing = prover.unrecorded()
    assert not missing, (f"no recorded proof for {missing}: run `python -m exactness prove "
                         f"--record` and commit proofs/verdicts.json")


def test_recorded_proofs_are_used_and_only_proofs(capsys, monkeypatch, tmp_path):
    o = activations.limb_split(16)
    key = prover.query_key(prover.query_of(o)[0])
    monkeypatch.setattr(prover, "CACHE", tmp_path / "cache.json")
    for recorded, cached in (("proved", True), ("refuted", False)):
        (tmp_path / "recorded.json").write_text(json.dumps({key: {"verdict": recorded}}))
        monkeypatch.setattr(prover, "RECORDED", tmp_path / "recorded.json")
        assert prove(o, cache=prover._cache()).cached == cached
    with pytest.raises(SystemExit):
        main(["--record", "--k", "2048"])
    assert "--record proves the whole catalogue" in capsys.readouterr().err


def test_int32_combine_is_refuted_with_a_replayable_counterexample(capsys):
    # only the combine, what this test is about: the config's 20 other obligations are 25 s
    # of Z3 in a fresh clone, and the proofs stage proves the catalogue as the kernels compute
    code, got = verdicts(capsys, "--acc-bits", "32", "--a-bits", "16", "--k", "18432",
                         "--w-bits", "4", "--no-rounding", "--only", "combine-w4-a16-k18432")
    assert list(got) == ["combine-w4-a16-k18432"]
    v = got["combine-w4-a16-k18432"]
    assert code == 1 and v["verdict"] == "refuted" and v["model"]
    case, doc = read(v["counterexample"])
    assert doc["source"] == "proof" and doc["path"] == "simulated-dot32-acc32"
    wrong = run(case, doc["path"])
    assert (wrong != run(case, "reference")).any()  # the unsafe width really gives wrong bits
    assert (run(case, "simulated-dot32-acc64") == run(case, "reference")).all()


def test_only_an_obligation_of_the_catalogue_is_asked_for(capsys):
    with pytest.raises(SystemExit):
        main(["--json", "--only", "combine-w4-a16-k7169"])  # no such K: no such obligation
    assert "--only combine-w4-a16-k7169 names no obligation" in capsys.readouterr().err


def test_changing_a_width_in_the_description_changes_the_verdict(monkeypatch):
    assert prove(gemms.cpu_int_mm(7168, dataflow.DOT_ACC_BITS)).verdict == "proved"
    monkeypatch.setattr(dataflow, "DOT_ACC_BITS", 16)
    assert prove(gemms.cpu_int_mm(7168, dataflow.DOT_ACC_BITS)).verdict == "refuted"
    monkeypatch.setattr(dataflow, "COMBINE_ACC_BITS", 32)
    combines = [o for o in ob.for_config(4, 16, 7168, spread=0) if o.name.startswith("combine")]
    assert prove(combines[0]).verdict == "refuted"


def test_spread_past_the_limit_is_refuted():
    limit = dataflow.max_safe_spread(18432, 8, 16)
    assert prove_once(combine.combine(8, 16, 18432, 64, limit)).verdict == "proved"
    assert prove_once(combine.combine(8, 16, 18432, 64, limit + 1)).verdict == "refuted"


def test_an_unshifted_chain_past_its_bound_is_refuted(monkeypatch):
    assert prove(dots_spans.span_unshifted(16, dataflow.DOT_ACC_BITS)).verdict == "proved"
    limit = dataflow.span_size_limit(16)
    monkeypatch.setattr(dataflow, "span_size_limit", lambda act_bits=16: 2 * limit)
    assert prove(dots_spans.span_unshifted(16, dataflow.DOT_ACC_BITS)).verdict == "refuted"


def test_an_amx_span_summing_past_int32_is_refuted(monkeypatch):
    """A span's tile dots sum at most 1024 groups of u8 x u8 products (255 * 255 each); 1032
    would stay under 2**31, 1033 would pass it, and the proof says so."""
    assert prove_once(dots_amx.amx_span_dot(dataflow.DOT_ACC_BITS)).verdict == "proved"
    monkeypatch.setattr(dataflow, "AMX_SPAN_GROUPS", 1032)
    assert prove_once(dots_amx.amx_span_dot(dataflow.DOT_ACC_BITS)).verdict == "proved"
    monkeypatch.setattr(dataflow, "AMX_SPAN_GROUPS", 1033)
    assert prove_once(dots_amx.amx_span_dot(dataflow.DOT_ACC_BITS)).verdict == "refuted"


def test_an_amx_fold_past_s16_and_a_combine_past_int64_are_refuted(monkeypatch):
    """Folded weights one past span_fold_limit leave s16 (q = -8, f = 4096: 32768); a K at which
    (Qa + B) * sum |q * c| passes 2**63 - 1 is refuted, not proved, and the kernel refuses it
    (dataflow.amx_holds)."""
    limit = dataflow.span_fold_limit(4)
    monkeypatch.setattr(dataflow, "span_fold_limit", lambda w_bits=4: limit + 1)
    assert prove(dots_amx.amx_span_digits(4)).verdict == "refuted"
    monkeypatch.undo()
    k = 2**25  # (32767 + 32768) * 2**25 * 8 * 255 << 12 > 2**63
    assert not dataflow.amx_holds(k, 4, 16, 12) and dataflow.amx_holds(k // 2, 4, 16, 12)
    assert prove(dots_amx.amx_span_combine(4, 16, k, 12)).verdict == "refuted"


def test_rounding_proof_refutes_a_planted_rounding_bug():
    sticky = next(m for m in CATALOGUE if m.name == "sticky-bit-ignored")
    with applied(sticky):
        assert prove_once(rounding.rounding(BFLOAT16), timeout_s=120).verdict == "refuted"


@pytest.mark.parametrize(("old", "new"), [
    ("a + below_half + last_kept", "a + below_half"),  # ties toward zero, not to even
    ("field < emax - 1", "field < emax + 1"),  # taken past the largest finite binade
])
def test_the_fast_rounding_proof_refutes_a_planted_bug(old, new):
    """rounding-normal is a transcription of cpu_vnni.c's round8_normal: a transcription with
    either bug the C mutants plant (vnni-normal-rounding-*) must not prove."""
    assert prove_once(rounding.rounding_normal(BFLOAT16)).verdict == "proved"
    planted = Mutant("planted", "proofs.rounding:rounding_normal", old, new, "", ())
    _, mutated = mutated_function(planted)
    verdict = prove_once(mutated(BFLOAT16), timeout_s=120)  # the query's text names the bug
    assert verdict.verdict == "refuted" and verdict.model


# --------------------------------------------------------------------------- cross-checks


@given(st.sampled_from((4, 8)), st.sampled_from((4, 8, 16)), formats, st.data())
def test_real_group_dots_never_exceed_the_proved_bound(w_bits, a_bits, fmt, data):
    q = data.draw(int_weights(4, 64, w_bits))
    x = data.draw(activation_bits(2, 64, fmt, a_bits))
    qa, _ = quantize_activations(x, fmt, a_bits)
    biggest = max(int(np.abs(group_dots(row, q.reshape(4, 2, 32))).max()) for row in qa)
    target(float(biggest), label="max |P|")
    assert biggest <= group_dot_bound(w_bits, a_bits)


@given(st.sampled_from((4, 8)), st.sampled_from((4, 8, 16)), st.data())
def test_real_combine_never_exceeds_the_proved_bound(w_bits, a_bits, data):
    k = 128
    q = data.draw(int_weights(3, k, w_bits))
    x = data.draw(activation_bits(1, k, FLOAT32, a_bits, kind="extreme"))
    s = data.draw(scale_bits(3, k // 32, kind="spread"))
    ms, shift, emin, spread = split_scales(s)
    limit = dataflow.max_safe_spread(k, w_bits, a_bits)
    ok = spread <= limit
    qa, _ = quantize_activations(x, FLOAT32, a_bits)
    t = combine_groups(group_dots(qa[0], q.reshape(3, -1, 32))[ok], ms[ok],
                       shift[ok])
    ratios = [abs(int(t_n)) / dataflow.combine_bound(k, w_bits, a_bits, int(d))
              for t_n, d in zip(t, spread[ok], strict=True)]
    target(max(ratios, default=0.0), label="max |T| / bound")
    assert all(r <= 1 for r in ratios)


@pytest.mark.parametrize("w_bits, a_bits", [(4, 4), (4, 16), (8, 8), (8, 16)])
def test_the_extreme_input_attains_the_group_bound(w_bits, a_bits):
    case = extreme_case(w_bits, a_bits, 64, 0, 2)
    qa, _ = quantize_activations(case.x_bits, case.x_format, a_bits)
    p = group_dots(qa[0], case.q.reshape(1, 2, 32))
    assert (p == group_dot_bound(w_bits, a_bits)).all()


@given(st.data())
def test_simulated_dataflow_at_the_real_widths_equals_the_reference(data):
    """The description the proofs read, executed: it is the arithmetic the reference computes."""
    from exactness.suite.strategies import linear_cases

    case = data.draw(linear_cases(max_k=96, max_n=3, max_rows=2,
                                  act_bits_=INT8_KERNEL_ACT_BITS))
    _, _, _, spread = split_scales(case.scale_bits)
    fast = spread <= dataflow.certified_spread(case.shape[1], case.w_bits, case.act_bits)
    got, want = run(case, "simulated"), run(case, "reference")
    assert (got[:, fast] == want[:, fast]).all()


def test_the_int8_gemms_are_sliced_where_all_of_k_would_wrap():
    """All of K = 2**17 in one int32 sum is refuted; the CPU fallback's slices are proved, and
    they are what a layer of that K is proved against (issue 20: it wrapped there)."""
    assert prove(gemms.cpu_int_mm(2**17, dataflow.DOT_ACC_BITS), cache={}).verdict == "refuted"
    assert prove(gemms.cpu_int_mm(dataflow.INT_MM_CHUNK, dataflow.DOT_ACC_BITS),
                 cache={}).verdict == "proved"
    names = {o.name for o in ob.for_config(4, 16, 2**17)}
    assert f"cpu-int-mm-k{dataflow.INT_MM_CHUNK}" in names
    assert dataflow.int_mm_chunk(2**17) == dataflow.INT_MM_CHUNK
    assert dataflow.int_mm_chunk(7168) == 7168  # Kimi's K in one GEMM


@given(st.integers(1, 4), st.data())
def test_int8_digits_give_back_the_value_or_refuse_it(count, data):
    """The limbs the kernels multiply: signed base-256 digits that sum back to the value, of
    int32 and int64 alike, and an OverflowError where `count` digits cannot hold it."""
    lo, hi = -128 * (256**count - 1) // 255, 127 * (256**count - 1) // 255  # all -128, all 127
    values = data.draw(st.lists(st.integers(lo, hi), min_size=1, max_size=8))
    v = torch.tensor(values, dtype=torch.int64)
    digits = dataflow.int8_digits(v, count)
    assert digits.dtype == torch.int8 and digits.shape == (count, len(values))
    assert sum(digits[j].long() * 256**j for j in range(count)).tolist() == values
    int32 = [x for x in [*values, 2**31 - 1, -(2**31)] if lo <= x <= hi and abs(x) < 2**31]
    assert torch.equal(dataflow.int8_digits(torch.tensor(int32, dtype=torch.int32), count),
                       dataflow.int8_digits(torch.tensor(int32), count))  # no int32 step wraps
    past = data.draw(st.sampled_from([lo - 1, hi + 1]))
    with pytest.raises(OverflowError, match=f"^{count} int8 limbs do not hold these values$"):
        dataflow.int8_digits(torch.tensor([*values, past]), count)


def test_int8_digits_refuse_an_int32_past_four_digits():
    """Split in int32, 2**31 - 1 would wrap into a false fit of four digits."""
    with pytest.raises(OverflowError):
        dataflow.int8_digits(torch.tensor([2**31 - 1], dtype=torch.int32), 4)


@pytest.mark.parametrize("w_bits", [4, 8])
def test_folded_weight_max_is_the_largest_fold(w_bits):
    """The GPU folded path sizes its digits by it (folded_weight_limbs), so it must be the
    largest |q * ms| over every weight and scale of either sign, attained, not a bound above."""
    q = np.arange(-(2 ** (w_bits - 1)), 2 ** (w_bits - 1))
    ms = np.arange(-255, 256)
    largest = int(np.abs(np.outer(q, ms)).max())
    for spread in (0, 1, 7):
        assert dataflow.folded_weight_max(w_bits, spread) == largest << spread
        assert dataflow.folded_weight_limbs(w_bits, spread) == dataflow.weight_limbs_needed(
            -largest << spread, largest << spread)


def test_int_mm_bound_is_the_attained_worst_sum():
    """It decides where the GPU may take torch._int_mm (triton.folded.folded_fits): the worst
    |sum| of k int8 products, attained with every limb -128, under 2**31 at the CPU's slices."""
    for k in (1, 32, 96):
        limbs = torch.full((1, k), -128, dtype=torch.int64)
        assert int((limbs @ limbs.T).item()) == dataflow.int_mm_bound(k)
    chunk = dataflow.INT_MM_CHUNK
    assert dataflow.int_mm_bound(chunk) < 2**31 <= dataflow.int_mm_bound(2 * chunk)


@pytest.mark.parametrize("acc_bits", [32, 64])
def test_max_safe_spread_is_the_largest_spread_that_fits(acc_bits):
    """The largest spread whose combine_bound fits a signed acc_bits accumulator, -1 where
    none does (an int32 combine at Kimi's sizes): the certificate's limit, from both sides."""
    limit = 2 ** (acc_bits - 1) - 1
    for k in (32, 256, 7168, 18432):
        for w_bits in (4, 8):
            for act_bits in (8, 16, 32):
                spread = dataflow.max_safe_spread(k, w_bits, act_bits, acc_bits)
                assert dataflow.combine_bound(k, w_bits, act_bits, spread + 1) > limit
                assert spread == -1 or dataflow.combine_bound(k, w_bits, act_bits,
                                                              spread) <= limit
    assert dataflow.max_safe_spread(7168, 4, 16, 32) == -1
    # so an int32 combine certifies no spread: `prove --acc-bits 32` checks spread 0, not 64's
    assert dataflow.certified_spread(7168, 4, 16, 32) == -1


def test_weight_limbs_needed_at_each_counts_edges():
    """c signed int8 digits hold exactly [-128 S, 127 S], S = (256**c - 1) / 255: one step
    past either end takes one more digit (the CPU path sizes its folded weights' digits so)."""
    assert dataflow.weight_limbs_needed(0, 0) == 1
    for count in (1, 2, 3, 4):
        span = (256**count - 1) // 255
        assert dataflow.weight_limbs_needed(-128 * span, 127 * span) == count
        assert dataflow.weight_limbs_needed(-128 * span - 1, 0) == count + 1
        assert dataflow.weight_limbs_needed(0, 127 * span + 1) == count + 1


@pytest.mark.parametrize("w_bits, act_bits", [(4, 8), (4, 16), (8, 16), (8, 32)])
def test_the_wide_kernels_int64_sums_hold_their_worst_groups(w_bits, act_bits):
    """wide.combine sums dataflow.wide_groups_per_sum groups' P * ms in int64 at a time: the
    most whose worst sum int64 holds (one more could pass 2**63 - 1), so no int64 sum wraps and
    none is cut short. At 8-bit weights and 32-bit activations that is 4112 groups, and one slice
    more of them at the worst P and scale still gives the exact T."""
    from exactness.kernels.wide import combine

    worst = group_dot_bound(w_bits, act_bits) * (2**dataflow.SCALE_MANT_BITS - 1)
    count = dataflow.wide_groups_per_sum(w_bits, act_bits)
    assert count * worst <= 2**63 - 1 < (count + 1) * worst
    if (w_bits, act_bits) == (8, 32):
        assert count == 4112
        p = torch.full((1, count + 5), group_dot_bound(w_bits, act_bits), dtype=torch.int64)
        ms = torch.full((count + 5,), -255, dtype=torch.int64)
        shift = torch.zeros(count + 5, dtype=torch.int64)
        assert combine(p, ms, shift, count) == [-worst * (count + 5)]


@pytest.mark.parametrize("act_bits", [4, 8, 16, 32])
def test_activation_limbs_recombine_at_every_width(act_bits):
    """qa in [-Qa, Qa] as 1, 1, 2 or 4 int8 limbs of qa minus the offset (0, 0, 128, 0x808080:
    written out here, not read from dataflow), at both ends and between."""
    qmax = 2 ** (act_bits - 1) - 1
    limbs, offset = {4: (1, 0), 8: (1, 0), 16: (2, 128), 32: (4, 0x808080)}[act_bits]
    qa = torch.tensor([-qmax, -qmax + 1, -1, 0, 1, qmax - 1, qmax, qmax // 3, -qmax // 5])
    digits = dataflow.activation_limbs(qa, act_bits)
    assert digits.dtype == torch.int8 and digits.shape == (limbs, qa.numel())
    back = sum(digits[i].long() << (8 * i) for i in range(limbs)) + offset
    assert torch.equal(back, qa)


@pytest.mark.parametrize("act_bits", [4, 8, 16, 32])
def test_the_limb_split_is_proved_at_every_width(act_bits):
    assert prove(activations.limb_split(act_bits)).verdict == "proved"


def test_a_32_bit_group_sum_in_int32_is_refuted():
    """The wide kernel sums a 32-bit group in int64: int32 would wrap (its obligation at the
    wrong width is refuted), and so would the int8 kernels' dot width."""
    assert dataflow.group_sum_bits(4, 32) == 64 and dataflow.group_sum_bits(4, 16) == 32
    with mock.patch.object(dataflow, "group_sum_bits", lambda w, a: 32):
        assert prove(combine.wide_group_sum(4, 32)).verdict == "refuted"
    assert prove(combine.wide_group_sum(4, 32)).verdict == "proved"


def test_the_avx2_dots_are_proved_and_refuted_past_their_widths(monkeypatch):
    """kernel_avx2.h's vpmaddubsw pairs of 4-bit fields fit int16, two added, at every width;
    at 8-bit fields they would saturate, so those take vpmaddwd (proved). A group's words summed
    in int32 and the offset taken off on the activations' side are proved, and refuted where
    the group were 1024 k of 8-bit fields (a width the combine, not int32, could hold)."""
    for a_bits in (4, 8, 16, 32):
        assert prove_once(dots_avx2.avx2_nibble_pairs(a_bits)).verdict == "proved"
        assert prove_once(dots_avx2.avx2_byte_words(a_bits)).verdict == "proved"
        for half in dots_avx2.avx2_halves(a_bits):
            for w_bits in (4, 8):
                group_sum = dots_avx2.avx2_group_sum(w_bits, a_bits, half)
                assert prove_once(group_sum).verdict == "proved"
                assert prove_once(dots_avx2.avx2_offset(w_bits, a_bits, half)).verdict == "proved"
    assert prove(dots_avx2.avx2_nibble_pairs(16, field_max=255), cache={}).verdict == "refuted"
    with monkeypatch.context() as patch:  # a group of 2**10 k
        patch.setattr(dots_avx2, "GROUP_SIZE", 1024)
        assert prove(dots_avx2.avx2_group_sum(8, 32, (0, 1)), cache={}).verdict == "refuted"


def test_the_int64_matmul_is_refuted_one_step_past_the_certified_spread():
    limit = dataflow.certified_spread(18432, 4, 32)
    assert prove_once(gemms.cpu_int64_matmul(4, 32, 18432, limit)).verdict == "proved"
    assert prove_once(gemms.cpu_int64_matmul(4, 32, 18432, limit + 3)).verdict == "refuted"


def test_the_float64_gemm_is_proved_where_its_check_admits_it_and_refuted_past():
    """gemm.FLOAT64_GEMM's runtime check (dataflow.float64_gemm_holds) and its proof agree: at
    K = 18432, spread 11 stays within 2**53, spread 12 can pass it."""
    assert dataflow.float64_gemm_holds(18432, 4, 11) and not dataflow.float64_gemm_holds(
        18432, 4, 12)
    assert prove_once(gemms.cpu_float64_gemm(4, 32, 18432, 11)).verdict == "proved"
    assert prove_once(gemms.cpu_float64_gemm(4, 32, 18432, 12)).verdict == "refuted"


def test_the_four_limb_proofs_refute_planted_bugs(monkeypatch):
    """vnni-four-limbs and the four-limb terms at Kimi's gate/up, 8-bit weights: proved as the
    kernels compute; refuted where the limbs' bias is 64, not the 128 that the correction
    2**15 * sum_k q cancels, and at a spread whose terms int64 cannot hold."""
    four = dots.vnni_four_limbs(8, 32, dataflow.DOT_ACC_BITS)
    assert prove(four, cache={}).verdict == "proved"
    limit = dataflow.certified_spread(7168, 8, 32)
    for kind in ("vnni", "group", "avx2"):  # the C kernel's builds' terms, the Triton kernels'
        terms = (dots.four_limb_terms(8, 32, 7168, spread, kind) for spread in (limit, 40))
        assert [prove(o, cache={}).verdict for o in terms] == ["proved", "refuted"]
    monkeypatch.setattr(dataflow, "LIMB_OFFSET", 64)  # the biased dots' offset one place short
    assert prove(dots.vnni_four_limbs(8, 32, dataflow.DOT_ACC_BITS), cache={}).verdict == "refuted"
