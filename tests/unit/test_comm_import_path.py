"""One import path for HorovodComm: `pdv_ext.comm.HorovodComm`; `pdv_ext.horovod.HorovodComm` is a
deprecated alias of the same class (issue #21 item 5). Neither needs a running Horovod job."""
import warnings

import pytest


def test_comm_path_is_the_one_and_warns_nothing():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        from pdv_ext.comm import HorovodComm
        from pdv_ext.comm.horovod_comm import HorovodComm as Impl
    assert HorovodComm is Impl


def test_horovod_module_alias_warns_and_is_the_same_class():
    import pdv_ext.horovod as ph
    from pdv_ext.comm import HorovodComm

    with pytest.warns(DeprecationWarning, match=r"from pdv_ext\.comm import HorovodComm"):
        alias = ph.HorovodComm
    assert alias is HorovodComm
    with pytest.warns(DeprecationWarning):
        from pdv_ext.horovod import HorovodComm as again  # noqa: F401
    assert "HorovodComm" not in ph.__all__  # `import *` does not hand out the old path


def test_other_horovod_names_do_not_warn_and_unknown_names_fail():
    import pdv_ext.horovod as ph

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert callable(ph.DistributedOptimizer) and callable(ph.PolicyHook)
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        ph.Nope
