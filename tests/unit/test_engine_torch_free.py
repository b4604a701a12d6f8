import pathlib
import subprocess
import sys

import foveal.engine

ENGINE_DIR = pathlib.Path(foveal.engine.__file__).parent
ENGINE_MODULES = sorted(p.stem for p in ENGINE_DIR.glob("*.py") if p.stem != "__init__")


def test_engine_package_imports_no_torch():
    assert {"core", "kv_manager", "scheduler", "plan"} <= set(ENGINE_MODULES)
    imports = "; ".join(f"import foveal.engine.{name}" for name in ENGINE_MODULES)
    code = f"import sys; {imports}; assert 'torch' not in sys.modules, 'torch was imported'"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
