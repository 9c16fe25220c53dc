"""bench/schedule_replay.py: the paged engine's schedule replayed on the CPU with a tiny model, and its price."""
from bench.schedule_replay import COST, replay, step_s


def test_the_replay_runs_the_engines_schedule_under_both_page_policies_and_prices_it():
    """Six requests of 48 + 40 tokens over 24 pages of 16 (four requests' whole contexts): taking pages as tokens
    are made the engine preempts, holding them all it does not; every step is priced by the rows it computes (8 as
    16: the fewest priced that hold them)."""
    assert step_s(8) == COST["step_s"][16] and step_s(128) == COST["step_s"][64]
    grow = replay(24, "grow", requests=6, prompt=48, new=40, slots=8, page_size=16)
    reserve = replay(24, "reserve", requests=6, prompt=48, new=40, slots=8, page_size=16)
    assert grow["preempted"] > 0 and reserve["preempted"] == 0
    for run in (grow, reserve):
        assert sum(run["steps_by_rows"].values()) == run["decode_steps"] >= 39
        assert run["prefilled_tokens"] >= 6 * 48
        assert run["model_s"] > sum(n * step_s(int(rows)) for rows, n in run["steps_by_rows"].items())
    assert reserve["decode_steps"] >= 2 * 39  # four at once: two waves
    assert grow["prefilled_tokens"] > reserve["prefilled_tokens"]  # the preempted prefilled again
