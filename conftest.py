"""Root conftest: loaded before anything under tests/, jax_blocksparse/ or docs/ is collected.

``pytest`` collects three trees (pyproject's ``testpaths``): the tests, the package's
docstring examples (``--doctest-modules``) and the user guide's examples
(``--doctest-glob=*.rst`` under docs/). The docstring and guide examples import jax
themselves, outside tests/conftest.py, so what they need from the process is set up
here, before the first jax import: 8 host devices on the CPU backend, as the tests and
the multi-device examples assume.
"""

import os

_FLAG = "--xla_force_host_platform_device_count"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_FLAG}=8".strip()

# Sphinx's configuration is a script, and its figures' extension needs Sphinx: neither
# is a module with examples; docs/_build is the output of a local docs build
# (docs/guide/development.rst).
collect_ignore = ["docs/conf.py", "docs/_bench_figures.py"]
collect_ignore_glob = ["docs/_build/*"]
