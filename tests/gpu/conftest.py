"""GPU tier: `make test-gpu` / scripts/gpu_check.sh run it with pytest-xdist (`-n auto --dist loadgroup`) where
it is installed. Tests that share an expensive module-scoped fixture carry `xdist_group` so one worker runs
the fixture once (registered here, so the marker is known without xdist too)."""


def pytest_configure(config):
    config.addinivalue_line("markers", "xdist_group(name): run these tests on one pytest-xdist worker "
                                       "(--dist loadgroup), e.g. users of one module-scoped fixture")
