"""The prefix cache's eviction replayed without a model: the default weights keep what LRU
keeps and more where shared prefixes compete with many unshared snapshots."""

from mambastep.tools import prefix_replay


def test_the_default_eviction_restores_at_least_what_lru_does(capsys):
    work = prefix_replay.workloads()
    for name, prompts in work.items():
        lru = prefix_replay.replay(prompts, 21, 128, 0.0, 0.0)
        default = prefix_replay.replay(prompts, 21, 128, 1.0, 1.0)
        assert default >= lru, name
    twelve = work["agentic, 64 prompts, 12 prefixes"]
    assert prefix_replay.replay(twelve, 21, 128, 1.0, 1.0) > 0.5 > prefix_replay.replay(twelve, 21, 128, 0.0, 0.0)
    assert prefix_replay.main(["--slots", "4"]) == 0
    assert "| 4 | agentic, 32 prompts, 4 prefixes |" in capsys.readouterr().out
