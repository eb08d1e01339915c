"""marinctl: the Marin 535B-A23B pretraining recipe as a command-line run toolkit."""

__version__ = "0.1.0"
