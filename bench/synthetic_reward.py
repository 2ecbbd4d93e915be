"""Rule reward of bench/ppo_step.py: the fraction of response tokens ``t<i>`` with an even ``i``.

Cheap, deterministic, and non-constant, so advantages, the critic and the policy loss all see a
real signal; the benchmark measures speed, not what is learnt.
"""


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    words = solution_str.split()
    even = sum(1 for w in words if w.startswith("t") and w[1:].isdigit() and int(w[1:]) % 2 == 0)
    return even / max(1, len(words))
