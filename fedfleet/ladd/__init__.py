"""The ``ladd`` simulate pipeline (``fedfleet/ladd/``): LADD vs FedAvg + self-training vs source-only over a real broker.

Per seed (the benchmark, the fleet's sampling and the head initialisation all follow it):

1. This process draws the synthetic benchmark (``fedfleet.emulation.synthetic_scenes``): a
   labelled source domain for the server, ``devices_per_domain`` unlabelled devices in each
   target domain, and per-domain test sets whose labels are only used for evaluation.
2. It runs the devices on :class:`fedfleet.simulate.EmulatedFleet`'s device hosts (the same
   emulation stack as every other pipeline; a LADD device's handlers, ``ladd.style`` and
   ``ladd.train`` on its own images, come from ``edge_client.handlers.ladd_handlers``), and one
   aggregator process (``python -m fedfleet.ladd.aggregator_process SPEC``) that runs the
   real ``AggregatorService`` three times over: the LADD job (style round -> clustering ->
   FDA pre-training on the source set -> T cluster-aware rounds), then the FedAvg +
   self-training job (same pre-trained model, one cluster), then trains the source-only
   model (no FDA). This is the layer allowed to import both sides: it injects the
   ``edge_client`` network into the aggregator's model-agnostic pre-training and evaluation
   (a LADD job built from its config alone starts from a stored pretrained network instead:
   ``LaddConfig.initial_model_file``, what ``aggregator serve`` and the admin API run).
3. It evaluates every saved model on the target test sets (mIoU per domain, per cluster;
   test images routed to the nearest style centroid for LADD), computes clustering purity
   against the true domains, and collects per-round costs from the workers and the service.

With ``secure`` (``--secure``) both federated jobs run as ``SecureLaddJob``
(``aggregator/jobs/secure_ladd.py``): every training round's updates reach the aggregator only
as one SecAgg(+) sum of cluster-slot vectors; the pipeline makes Ed25519 identities for the
aggregator and every device (key files under the seed's output directory).

Modules: ``config`` (the experiment's settings), ``run`` (``run_ladd(cfg) -> report``: the seeds,
the fleet, the independent evaluation), ``aggregator_process`` (the aggregator's side),
``metrics`` (confusion, mIoU, test sets), ``report`` (text and plots), ``pretrain`` (FDA
pre-training), ``cli`` (``fedfleet simulate --pipeline ladd`` options; ``python -m fedfleet.ladd``).
``--quick`` is a seconds-long variant for tests.

Method definitions (docs/ladd.md): *source-only* = trained on the source set without style
augmentation; *FDA pre-trained* = the common starting point of both federated methods;
*FedAvg + ST* = FedAvg over all tensors with the same local self-training objective
(pseudo-labels + KD, SWA teacher) but one global model, i.e. LADD without clusters
(``baseline_kd=False`` drops KD and SWA, the paper's Table 5 row); *LADD* = clusters of styles,
cluster-specific θ_c.
"""

from __future__ import annotations
