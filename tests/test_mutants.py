"""Every planted bug of the catalogue makes each of its killer tests fail."""

import importlib

import pytest

from exactness.mutants import CATALOGUE, Mutant, applied


def killer(node_id: str):
    path, name = node_id.split("::")
    module = importlib.import_module(path.removesuffix(".py").replace("/", "."))
    return getattr(module, name)


@pytest.mark.parametrize("mutant", CATALOGUE, ids=lambda m: m.name)
def test_mutant_is_killed(mutant: Mutant):
    survivors = []
    killers = {node_id: killer(node_id) for node_id in mutant.killers}
    with applied(mutant):
        for node_id, test in killers.items():
            try:
                test()
            except Exception:  # noqa: BLE001 - a failure or a crash both kill the mutant
                continue
            survivors.append(node_id)
    assert not survivors, f"{mutant.name} ({mutant.bug}) survived {survivors}"


@pytest.mark.parametrize("mutant", CATALOGUE, ids=lambda m: m.name)
def test_killers_pass_without_the_mutant(mutant: Mutant):
    for node_id in mutant.killers:
        killer(node_id)()


def test_applied_restores_the_original():
    mutant = CATALOGUE[0]
    import exactness.formats as formats

    before = formats.unpack_weights
    with applied(mutant):
        assert formats.unpack_weights is not before
    assert formats.unpack_weights is before
