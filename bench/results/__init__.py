"""Results as data: the records behind the docs' figures (record.py) and the tables made
from them (tables.py); the records are the *.jsonl files here (README.md)."""
