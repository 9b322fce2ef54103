"""Your own code for this Flower app: model factories, data loaders, losses.

Every ``*.py`` file in this folder travels in the app's FAB (``fab-include`` in pyproject.toml) to the
ServerApp and to every ClientApp of a ``flwr run``, where Flower puts the app folder on ``sys.path``. A
file ``custom/mymodel.py`` defining ``make(*, in_features, out_features, **kwargs)`` is named in an
experiment as ``model.name: custom.mymodel:make``; PYTHONPATH is not needed, and does not reach Flower's
SuperLink anyway.

Code only: data, outputs, keys and checkpoints never go here. Flower ships only .py, .toml, .md, .yaml,
.yml, .json and .jsonl files (10 MB in all), and leaves out files named ``test_*.py`` or ``*_test.py``.
Keep this ``__init__.py``: it makes ``custom`` one package, the app's own. See "Your own code in a Flower app"
in docs/tutorials/own-model-and-data.md.
"""
