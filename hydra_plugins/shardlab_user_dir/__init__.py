"""Puts a run's user_dir conf/ on Hydra's config search path, after shardlab's conf/ (shardlab/registry/user_dir.py).

A SearchPathPlugin rather than ``hydra.searchpath``: Hydra applies that override to each composition only, so
``--help`` would not list the user's options; a plugin shapes the search path every part of Hydra uses. Hydra finds
plugins only in the ``hydra_plugins`` namespace, hence this package.
"""

from hydra.core.config_search_path import ConfigSearchPath
from hydra.plugins.search_path_plugin import SearchPathPlugin


class ShardlabUserDirSearchPath(SearchPathPlugin):
    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        from shardlab.registry.user_dir import conf_on_search_path

        conf = conf_on_search_path()
        if conf is not None:
            search_path.append(provider="shardlab user_dir", path=f"file://{conf}")
