"""The fast paths: both compute T[r, n] = sum_k qa[r, k] * q[n, k] * ms[n, g] << shift[n, g]
exactly in int64 (docs/SPEC.md section 5); the one final rounding is formats.round_scaled_array.
"""
