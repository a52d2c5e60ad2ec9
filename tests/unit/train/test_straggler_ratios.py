"""`stragglers.ratios`: each rank against the median of its pipeline-stage peers (all other ranks
when alone in its stage), and the phase clock's split of a step into compute and waiting."""

import time

from megatron_bridge.train.stragglers import StepPhases, ratios


def test_ratio_against_the_median_of_the_peers():
    r = ratios([1.0, 1.0, 3.0, 1.0], [0, 0, 0, 0])
    assert r == [1.0, 1.0, 3.0, 1.0]
    # two ranks: each against the other, so a 4x rank reads 4 (not 4 / the mean of both)
    assert ratios([0.1, 0.4], [0, 0]) == [0.25, 4.0]


def test_pipeline_stages_are_compared_within_the_stage():
    # stage 1 does twice the work by design: nobody is slow; rank 3 is slow within stage 1
    assert ratios([1.0, 1.0, 2.0, 2.0], [0, 0, 1, 1]) == [1.0, 1.0, 1.0, 1.0]
    assert ratios([1.0, 1.0, 2.0, 6.0], [0, 0, 1, 1])[3] == 3.0
    # one rank per stage: against every other rank
    assert ratios([1.0, 1.0, 5.0], [0, 1, 2])[2] == 5.0
    assert ratios([0.0, 0.0], [0, 0]) == [1.0, 1.0]  # nothing measured: nobody named


def test_phases_split_compute_and_waiting():
    p = StepPhases()
    with p.waiting():  # outside a step (an evaluation): not counted
        time.sleep(0.01)
    p.start()
    time.sleep(0.02)
    p.marked(lambda: time.sleep(0.03))()
    p.stop()
    compute, wait, steps = p.take()
    assert steps == 1 and 0.03 <= wait < 0.06 and 0.02 <= compute < 0.05
    assert p.take() == (0.0, 0.0, 0)
