"""Built-in processing pipelines and the sample dataset.

The pipeline contract (docs/architecture.md, "Processing pipelines"): a
pipeline is a module with

* ``KD_FEATURES: list[str]`` (optional): the numeric features knowledge
  discovery clusters on;
* ``setup() -> None`` (optional): called once per engine, before any tuple;
* ``process(data: bytes, info) -> dict[str, float | str | list[float]]``:
  the features of one tuple. ``info`` is a ``hio.worker.TupleInfo`` (tuple_id,
  source, image, name, size, created_unix, attributes: a str -> str mapping,
  from which a pipeline may read per-tuple parameters).

``process`` must be deterministic for the same input (features are stored
once per tuple id, and a redelivered tuple must not change them) and must
raise ``ValueError`` with a clear message for input it cannot decode: the
engine reports that tuple as failed, and the message is what an operator
sees. Built-ins use only numpy, Pillow and the standard library (scipy, when
installed, only speeds up connected-component labelling).

Built-in pipelines, each described in its module: image ``hio/<name>`` runs
``hio.worker.pipelines.<name>:process`` (:func:`hio.worker.api.pipeline_for_image`)
for ``microscopy`` (TIFF/PNG fluorescence images), ``simulation`` (``.npz``/``.npy``
reaction-diffusion realizations) and ``synthetic`` (benchmark load).

:mod:`hio.worker.pipelines.samples` generates the deterministic sample
dataset (``generate_demo_dataset``) that the demo and the benchmarks stream.
:mod:`hio.worker.pipelines.imaging` (numpy image kernels) and
:mod:`hio.worker.pipelines.params` (bounded per-tuple attributes) are what the
built-ins share; they are not pipelines.
"""
