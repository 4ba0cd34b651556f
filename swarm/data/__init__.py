"""Training data by registry name plus a plain config dict, sampled so any batch can be recomputed.

- seeds.py: ``derive_seed(run_id, peer_id, step, micro)`` and the per-row offset recipe
- corpus.py: ``ByteDataset``: one uint8 array, a per-file validation split, a fingerprint, batches
- files.py: finding corpus files on disk in a machine-independent order
- builder.py: the dataset registry: ``register_dataset``, ``build_dataset``, ``available_datasets``
- sources.py: the built-in datasets ``stdlib`` (the default corpus) and ``text-files``
- tokens.py: ``TokenDataset``: tokenized documents in two arrays, sampled by the same recipe
- hf.py: ``hf-dataset``: local text, JSON lines or Parquet files through ``datasets`` and a local
  tokenizer (the ``[hf]`` extra, imported when built)

Example::

    from swarm.data import build_dataset, derive_seed
    dataset = build_dataset("stdlib")
    inputs, targets = dataset.sample_batch(derive_seed("demo", "peer-a", step=0), batch_size=8, seq_len=128)

More datasets come from installed packages through the ``swarm.datasets`` entry point group, exactly as
models do through ``swarm.models`` (see :mod:`swarm.models`).
"""

from swarm.data.builder import DATASETS, available_datasets, build_dataset, dataset_config, register_dataset
from swarm.data.corpus import SEPARATOR, ByteDataset, split_score
from swarm.data.hf import HFDatasetConfig
from swarm.data.seeds import derive_seed
from swarm.data.sources import StdlibConfig, TextFilesConfig
from swarm.data.tokens import TokenDataset

__all__ = [
    "DATASETS",
    "SEPARATOR",
    "ByteDataset",
    "HFDatasetConfig",
    "StdlibConfig",
    "TextFilesConfig",
    "TokenDataset",
    "available_datasets",
    "build_dataset",
    "dataset_config",
    "derive_seed",
    "register_dataset",
    "split_score",
]
