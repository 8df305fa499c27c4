"""`pdv_ext.exit_on_config_error`: a ConfigError ends a run with its lines once (rank 0), status 2 on every
rank, no traceback; any other error propagates unchanged."""
import pytest

import pdv_ext
from pdv_ext.config import ConfigError


@pdv_ext.exit_on_config_error
def bad_main():
    raise ConfigError(["pdv.aggregation.type: unknown aggregator 'adasun'", "pdv.policy.every: must be >= 1"])


@pytest.mark.parametrize("env, printed", [({"RANK": "0"}, True), ({"RANK": "3"}, False),
                                          ({"OMPI_COMM_WORLD_RANK": "1"}, False), ({}, True)])
def test_rank_0_prints_the_lines_and_every_rank_exits_2(monkeypatch, capsys, env, printed):
    for name in ("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "HOROVOD_RANK"):
        monkeypatch.delenv(name, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(SystemExit) as exc:
        bad_main()
    assert exc.value.code == 2
    err = capsys.readouterr().err.splitlines()
    assert err == (["pdv_ext: invalid configuration (fix it and run again; `pdv check-config FILE` checks a file):",
                    "  pdv.aggregation.type: unknown aggregator 'adasun'", "  pdv.policy.every: must be >= 1"]
                   if printed else [])


def test_other_errors_propagate_and_results_pass_through():
    @pdv_ext.exit_on_config_error
    def broken():
        raise RuntimeError("not a config problem")

    with pytest.raises(RuntimeError, match="not a config problem"):
        broken()
    assert pdv_ext.exit_on_config_error(lambda x: x + 1)(1) == 2
