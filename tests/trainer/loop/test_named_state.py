"""Named states (``trainer.loop.named_state``): what a job may declare, and their state in and out."""
from __future__ import annotations

import pytest
import torch
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from trainer.loop.named_state import NamedStates, StateError, per_rank, unwrap


def _states(**kw: object) -> NamedStates:
    model = torch.nn.Linear(2, 2)
    return NamedStates.declare(kw, where="task t:build", optimizers=[torch.optim.SGD(model.parameters(), lr=1)])


@pytest.mark.parametrize("states, why", [
    ({"optimizer": torch.nn.Linear(1, 1)}, "name 'optimizer' is not allowed"),
    ({"1st": torch.nn.Linear(1, 1)}, "name '1st' is not allowed"),
    ({"noise": object()}, r"states\['noise'\]: a object has no state_dict\(\)"),
    ({"data": torch.utils.data.DataLoader([1, 2])}, "name 'data' is not allowed"),
    ({"loader": torch.utils.data.DataLoader([1, 2])}, "a torch DataLoader cannot save its position"),
])
def test_what_cannot_be_checkpointed_is_refused_naming_it(states: dict, why: str) -> None:
    with pytest.raises(StateError, match=why):
        _states(**states)


def test_an_object_declared_twice_is_refused() -> None:
    m = torch.nn.Linear(1, 1)
    with pytest.raises(StateError, match="declared twice"):
        _states(a=m, b=m)


def test_state_that_is_not_plain_data_is_refused_before_any_step() -> None:
    class Custom:
        def state_dict(self) -> dict:
            return {"fn": lambda: 0}

        def load_state_dict(self, s: dict) -> None: ...

    ns = _states(custom=Custom())
    with pytest.raises(StateError, match=r"states\['custom'\].*without pickle"):
        ns.check("task t:build")


def test_an_ema_keeps_its_own_count_and_only_ddp_is_unwrapped() -> None:
    model = torch.nn.Linear(3, 3)
    ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.5))
    ema.update_parameters(model)
    ns = _states(ema=ema)
    saved = ns.replicated()["ema"]
    assert int(saved["n_averaged"]) == 1 and "module.weight" in saved  # the count travels with the weights
    assert unwrap(ema) is ema
    fresh = AveragedModel(torch.nn.Linear(3, 3), multi_avg_fn=get_ema_multi_avg_fn(0.5))
    ns2 = _states(ema=fresh)
    ns2.load(ns.replicated(), {})
    assert int(fresh.n_averaged) == 1 and torch.equal(fresh.module.weight, ema.module.weight)


def test_loaders_are_per_rank_and_models_train_when_an_optimizer_holds_them() -> None:
    from torchdata.stateful_dataloader import StatefulDataLoader

    disc, ema = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    opt_d = torch.optim.Adam(disc.parameters())
    loader = StatefulDataLoader(list(range(8)), batch_size=2)
    ns = _states(D=disc, opt_d=opt_d, ema=ema, loader=loader)
    assert per_rank(loader) and not per_rank(disc)
    assert set(ns.rank_local()) == {"loader"} and set(ns.replicated()) == {"D", "opt_d", "ema"}
    optimized = {id(p) for g in opt_d.param_groups for p in g["params"]}
    assert set(ns.trained_models(optimized)) == {"D"} and set(ns.models()) == {"D", "ema"}
    assert ns.fingerprint() == {"D": "Linear", "opt_d": "Adam", "ema": "Linear", "loader": "StatefulDataLoader"}
    with pytest.raises(KeyError, match="no state 'ema'"):
        ns.load({"D": disc.state_dict(), "opt_d": opt_d.state_dict()}, {"loader": loader.state_dict()})


def _gan() -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.nn.Module, torch.optim.Optimizer]:
    g, d = torch.nn.Sequential(torch.nn.Linear(2, 2)), torch.nn.Sequential(torch.nn.Linear(2, 1))
    return g, torch.optim.Adam(g.parameters()), d, torch.optim.Adam(d.parameters())


def test_under_fsdp_every_model_among_the_states_is_sharded_with_its_optimizer() -> None:
    """Issue 29: a second trained model and an EMA are no longer refused in the sharded layout;
    they leave the replicated rest, which keeps the other states."""
    g, opt_g, d, opt_d = _gan()
    ema = AveragedModel(g, multi_avg_fn=get_ema_multi_avg_fn(0.9))
    sched = torch.optim.lr_scheduler.StepLR(opt_d, 1)
    ns = NamedStates.declare({"D": d, "opt_d": opt_d, "ema": ema, "sched_d": sched, "buffers": torch.nn.Identity()},
                             where="task t:build", optimizers=[opt_g])
    plan = ns.shard_plan(g, opt_g, "task t:build")
    assert plan == {"D": (d, "opt_d", opt_d), "ema": (ema, None, None)}  # no parameters: nothing to shard
    assert ns.sharded == {"D", "opt_d", "ema"}
    assert set(ns.replicated()) == {"sched_d", "buffers"}
    assert sorted(ns.models()) == ["D", "buffers", "ema"]  # what export writes: the sharded ones too
    before = d[0].weight.detach().clone()
    with torch.no_grad():
        d[0].weight.add_(1.0)
    ns.load({"sched_d": sched.state_dict(), "buffers": {}}, {})  # the shards are the sharded layout's to load
    assert not torch.equal(d[0].weight, before)


@pytest.mark.parametrize("kind, why", [
    ("one_optimizer", r"Task.optimizer: it holds D and model; under parallelism = 'fsdp' an optimizer's state is "
                      r"sharded with its model"),
    ("second_optimizer_on_model", r"states\['opt_g2'\]: it trains the main model, which Task.optimizer trains"),
    ("two_optimizers_on_d", r"states\['D'\]: trained by states\['opt_d'\] and states\['opt_d2'\]"),
    ("part_of_model", r"states\['head'\]: its parameters are also model's"),
    ("free_and_model", r"states\['opt_d'\]: it holds D and parameters of no model"),
    ("swapped", r"Task.optimizer: it does not hold the parameters of Task.model"),
])
def test_what_cannot_be_sharded_beside_the_model_is_refused_naming_it(kind: str, why: str) -> None:
    g, opt_g, d, opt_d = _gan()
    states: dict = {"D": d, "opt_d": opt_d}
    if kind == "one_optimizer":
        opt_g = torch.optim.Adam([*g.parameters(), *d.parameters()])
        states = {"D": d}
    elif kind == "second_optimizer_on_model":
        states["opt_g2"] = torch.optim.SGD(g.parameters(), lr=1)
    elif kind == "two_optimizers_on_d":
        states["opt_d2"] = torch.optim.SGD(d.parameters(), lr=1)
    elif kind == "part_of_model":
        states["head"] = g[0]
    elif kind == "swapped":
        opt_g, states["opt_d"] = opt_d, opt_g
    else:
        states["opt_d"] = torch.optim.Adam([*d.parameters(), torch.nn.Parameter(torch.zeros(1))])
    ns = NamedStates.declare(states, where="task t:build", optimizers=[opt_g])
    with pytest.raises(StateError, match=r"^task t:build: " + why):
        ns.shard_plan(g, opt_g, "task t:build")


def test_an_optimizer_of_parameters_outside_any_model_stays_replicated_under_fsdp() -> None:
    g, opt_g, _, _ = _gan()
    temperature = torch.nn.Parameter(torch.ones(()))
    opt_t = torch.optim.SGD([temperature], lr=1)
    ns = NamedStates.declare({"opt_t": opt_t}, where="task t:build", optimizers=[opt_g])
    assert ns.shard_plan(g, opt_g, "task t:build") == {} and ns.sharded == set()
    assert set(ns.replicated()) == {"opt_t"}


def test_the_fingerprint_names_a_sharded_model_by_its_own_class() -> None:
    """fully_shard swaps a module's class for ``FSDP<name>`` on several ranks and not in one
    process: a resume at another world size must see the same states."""
    from torch.distributed.fsdp import FSDPModule

    d = torch.nn.Linear(2, 2)
    sharded = type("FSDPLinear", (FSDPModule, torch.nn.Linear), {})
    ns = _states(D=d)
    before = ns.fingerprint()
    d.__class__ = sharded
    assert ns.fingerprint() == before == {"D": "Linear"}
