from qiao.version import __version__
