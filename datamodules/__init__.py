"""Lightning data modules for mixlab (installed as ``mixlab.datamodules``).

Import a module explicitly, e.g. ``from mixlab.datamodules.genome import GenomeDataModule``;
this package deliberately imports nothing heavy. Datamodules never import heads: a head pulls
what it needs from the attached datamodule (:meth:`mixlab.heads.common.Head.data_attr`), and
every attribute below is optional (a head skips its check when it is absent).

The datamodule contract: what mixlab reads from a datamodule.

========================  ====================================  =======================================================
attribute                 type                                  read by
========================  ====================================  =======================================================
``task_name``             ``str``                               CLI (run folder ``runs/<task_name>/<run>``), TensorBoard
                                                                HParams, headline metric
                                                                (:data:`mixlab.eval.metrics.TASK_METRICS`)
``hparams``               dict (``save_hyperparameters()``)     every head: recorded in checkpoints as
                                                                ``checkpoint["mixlab"]["data_args"]``; the evaluation
                                                                commands rebuild the datamodule from it
``vocab_size``            ``int``                               CausalLM, SyntheticLM (must not exceed the model's),
                                                                SpatialVQA (must equal the model's)
``token_unit``            ``str`` (``"base"``, ``"byte"``, ...)  CausalLM: logs ``bits_per_<unit>`` besides per token
``task_metrics``          ``(logits [B, T, V], batch dict) ->   SyntheticLM: logged as ``<stage>/<name>`` = sum / count
                          {name: (sum, count)}``                over the epoch
``num_classes``           ``int``                               ImageClassifier (must equal the model's)
``image_size``,           ``int`` or ``[height, width]``        ImageClassifier: sides must be multiples of the patch
``eval_size``                                                   size (checked in ``setup``); ``resolution`` sets
                                                                ``eval_size``
``n_answers``,            ``int``                               SpatialVQA (must equal the model's)
``patch_dim``
``order_names``           ``list[str]`` (index = order id)      SpatialVQA: per-order test metrics
``heldout_order_ids``     ``list[int]``                         SpatialVQA: ``test/acc_seen`` vs ``test/acc_heldout``
``question_types``        ``list[str]`` (index = type id)       SpatialVQA: per-question-type test accuracy
``windows(split, length,  dataset of ``LongTensor [length]``    ``length-extrapolation`` command
max_windows)``
``context_length``,       constructor arguments (``hparams``)   ``length-extrapolation``, ``passkey``, ``niah``
``haystack``,                                                   (training length and haystack)
``essay_path``
========================  ====================================  =======================================================

Batches are the heads' business (documented on each head): ``LongTensor [B, L + 1]`` for
CausalLM, dicts for SyntheticLM and SpatialVQA, ``(images, labels)`` for ImageClassifier.
"""
