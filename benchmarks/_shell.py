"""A real IPython shell with nbtool loaded, for benchmarks (not a test fixture)."""
from IPython.testing.globalipapp import start_ipython


def shell():
    ip = start_ipython()
    ip.run_line_magic("load_ext", "nbtool")
    return ip


def nbtool_cluster(ip):
    return ip.magics_manager.registry["NbtoolMagics"].rank_cluster
