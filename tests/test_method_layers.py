"""Block drafters tap the layers their method's recipe reads: 02 extracts them when its aux_layer_ids is unset and
the run's 03 trains such a method, and 03 refuses states 02 chose for another method."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from eagle3nb.drafts import DEFAULT, fresh_num_layers
from eagle3nb.layers import default_aux_layer_ids, spread_layer_ids

L = 8  # the toys' decoder layers


def run_folder(tmp: Path, hidden: dict, train: dict) -> Path:
    """A run's parameter folder with 02's and 03's YAML."""
    tmp.mkdir(exist_ok=True)
    (tmp / "02_hidden_states.yaml").write_text(yaml.safe_dump(hidden))
    (tmp / "03_train.yaml").write_text(yaml.safe_dump(train))
    return tmp


def layers_02(folder: Path) -> list[int]:
    """The layers 02 would extract for the run in ``folder`` from an L-layer target."""
    from eagle3nb.hidden.prepare import aux_layer_ids
    from eagle3nb.params import from_dict
    from eagle3nb.params_yaml import run_params

    return aux_layer_ids(from_dict("02_hidden_states", run_params(folder, "02_hidden_states")), L)


@pytest.mark.parametrize("method", ["dflash", "dspark", "dflash2"])
def test_02_extracts_a_block_drafters_spread_for_its_run(method, tmp_path):
    spread = spread_layer_ids(L, fresh_num_layers(method))
    assert spread != default_aux_layer_ids(L)
    assert layers_02(run_folder(tmp_path / "own", {}, {"method": method})) == spread
    assert layers_02(run_folder(tmp_path / "deep", {}, {"method": method, "num_layers": 3})) == \
        spread_layer_ids(L, 3)
    assert layers_02(run_folder(tmp_path / "set", {"aux_layer_ids": [1, 3]}, {"method": method})) == [1, 3]


def test_02_keeps_eagle3s_layers_for_an_eagle3_run_and_outside_a_run_folder(tmp_path):
    from eagle3nb.hidden.prepare import aux_layer_ids
    from eagle3nb.params import from_dict

    assert layers_02(run_folder(tmp_path / "e", {}, {})) == default_aux_layer_ids(L)
    assert layers_02(run_folder(tmp_path / "e3", {}, {"method": DEFAULT})) == default_aux_layer_ids(L)
    assert aux_layer_ids(from_dict("02_hidden_states", {}), L) == default_aux_layer_ids(L)


def test_03_refuses_states_02_chose_for_another_method(tmp_path):
    """States 02 extracted by EAGLE-3's recipe (its index.json records the draft they were for), 03 then switched
    to DFlash: refused in one line naming 02's aux_layer_ids; the spread, ids the user set in 02 (recorded as no
    recipe's) and states recorded without the note pass."""
    from eagle3nb.params import ParamsError, from_dict

    dflash = from_dict("03_train", {"method": "dflash", "block_size": 4, "num_speculative_tokens": 3})
    eagle = {"num_layers": L, "layer_ids": default_aux_layer_ids(L), "layers_for": {"method": DEFAULT}}
    with pytest.raises(ParamsError, match="aux_layer_ids") as e:
        dflash.check_states(eagle)
    assert "\n" not in str(e.value) and str(spread_layer_ids(L, fresh_num_layers("dflash"))) in str(e.value)
    dflash.check_states({**eagle, "layer_ids": spread_layer_ids(L, fresh_num_layers("dflash"))})
    from_dict("03_train", {}).check_states(eagle)  # EAGLE-3's own
    dflash.check_states({**eagle, "layers_for": None})  # the user's ids
    dflash.check_states({k: v for k, v in eagle.items() if k != "layers_for"})  # states from before the note


def test_the_run_plan_hands_02_the_draft_03_trains_and_no_stage_reads_another_stages_file(tmp_path):
    """02's draft_method / draft_num_layers come from 03's file through the run's plan (params_yaml.run_params),
    an error in them names 03's file, a value set in 02's own file wins, and 02 records which draft chose its layers
    in index.json (what 03 checks)."""
    from eagle3nb.hidden.prepare import layers_for
    from eagle3nb.params import ParamsError, from_dict
    from eagle3nb.params_yaml import run_params

    folder = run_folder(tmp_path / "r", {}, {"method": "dflash", "num_layers": 3})
    P2 = from_dict("02_hidden_states", run_params(folder, "02_hidden_states"))
    assert (P2.draft_method, P2.draft_num_layers) == ("dflash", 3)
    assert layers_for(P2) == {"method": "dflash", "num_layers": 3}
    own = run_folder(tmp_path / "o", {"draft_method": DEFAULT, "aux_layer_ids": [1, 3]}, {"method": "dflash"})
    P2 = from_dict("02_hidden_states", run_params(own, "02_hidden_states"))
    assert P2.draft_method == DEFAULT and layers_for(P2) is None  # the user's ids
    assert layers_for(from_dict("02_hidden_states", {})) is None  # outside a run folder: taken as stored
    bad = run_folder(tmp_path / "b", {}, {"method": "dflsh"})
    with pytest.raises(ParamsError, match=r"draft_method.* in .*03_train\.yaml's method"):
        from_dict("02_hidden_states", run_params(bad, "02_hidden_states"))
