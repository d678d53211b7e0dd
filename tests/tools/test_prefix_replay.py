"""The prefix cache's eviction replayed without a model: the default policy keeps what LRU
keeps, and more where shared prefixes compete with many unshared snapshots, superseded
conversation ends crowd out live ones, or more live conversations than slots come in turn."""

from mambastep.tools import prefix_replay


def test_the_default_eviction_restores_at_least_what_lru_does(capsys):
    work = prefix_replay.workloads()
    for name, prompts in work.items():
        for slots in (21, 53):
            lru = prefix_replay.replay(prompts, slots, 128, 0.0, 0.0, False, False)
            unguarded = prefix_replay.replay(prompts, slots, 128, 1.0, 1.0, True, False)
            default = prefix_replay.replay(prompts, slots, 128, 1.0, 1.0, True, True)
            assert default >= unguarded >= lru, (name, slots)
    twelve = work["agentic, 64 prompts, 12 prefixes"]
    assert (prefix_replay.replay(twelve, 21, 128, 1.0, 1.0, True, False) > 0.5
            > prefix_replay.replay(twelve, 21, 128, 0, 0, False, False))
    forty = work["multi-turn, 40 conversations, 4k first prompts"]
    assert (prefix_replay.replay(forty, 53, 128, 0, 0, True, False) > 0.5
            > prefix_replay.replay(forty, 53, 128, 0, 0, False, False))
    # forty live conversations over 21 slots: nothing restored but with the thrash guard
    assert (prefix_replay.replay(forty, 21, 128, 1.0, 1.0, True, True) > 0.15
            > prefix_replay.replay(forty, 21, 128, 1.0, 1.0, True, False) == 0)
    assert prefix_replay.main(["--slots", "4"]) == 0
    assert "| 4 | agentic, 32 prompts, 4 prefixes |" in capsys.readouterr().out
