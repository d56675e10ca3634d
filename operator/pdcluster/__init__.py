"""pdcluster-operator: disaggregated prefill/decode LLM serving on Kubernetes."""

__version__ = "0.1.0"


def add_version_flag(parser) -> None:  # an argparse.ArgumentParser; argparse is not imported for this
    """`--version` on every console script: the program and the release it is."""
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
