"""The FMA-peak yardstick computes what it claims: every chain of every thread is the FMA
recurrence, checked against float64 on values float32 holds exactly."""

import numpy as np

from pagelm.bench import fma_peak


def _recurrence(rounds: int, w: float, c: float) -> float:
    a = 0.0
    for _ in range(rounds):
        a = a * w + c
    return a


def test_every_chain_of_every_thread_is_the_fma_recurrence():
    for rounds, w, c, threads in ((7, 1.5, 0.25, 3), (1000, 1.0, 1.0, 2), (0, 2.0, 1.0, 1)):
        values = fma_peak.chain_values(rounds, w, c, threads)
        assert values.shape == (threads, fma_peak.CHAINS)
        assert np.all(values == np.float32(_recurrence(rounds, w, c))), (rounds, w, c)


def test_the_peak_is_a_rate():
    assert fma_peak.fma_peak_gflops(threads=1, seconds=0.01) > 0
