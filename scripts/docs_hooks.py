"""MkDocs hooks (mkdocs.yml ``hooks:``): add the generated reference pages to the site while it
builds.

``reference/configuration.md`` comes from the settings' declarations and ``reference/cli.md`` from
the ``diff2`` parser (diff2_flwr/cli/docs.py), so neither can drift from the code. A setting without
help text fails the build.
"""

from __future__ import annotations

from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File, Files

from diff2_flwr.cli.docs import GENERATED


def on_files(files: Files, config) -> Files:
    """MkDocs' ``on_files`` hook: add each generated page to the site's files; a PluginError when
    docs/ holds a copy of one, or when one cannot be rendered (e.g. a setting without help)."""
    for path, render in GENERATED.items():
        if files.get_file_from_path(path) is not None:
            raise PluginError(
                f"docs/{path} is generated while the site builds: delete the file in docs/")
        try:
            content = render()
        except ValueError as err:
            raise PluginError(str(err)) from None
        files.append(File.generated(config, path, content=content))
    return files
