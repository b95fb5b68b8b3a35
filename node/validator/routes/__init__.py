"""The validator's HTTP routes, one module per caller.

* ``public``: unsigned reads anyone may make (health, metrics, node info,
  policy manifests, recorded evals, blobs);
* ``contributor``: calls signed by a contributor's key (register, assign) and
  rollout submissions;
* ``trainer``: calls only the trainer key may make (publish a policy, record an
  eval, store a blob, read accepted samples).

Each module has one ``add_*_routes(app, node)`` that declares its routes on the
app; ``common`` holds what they share (``Serving``: the validator, metrics,
worker thread and rate limits of one app; the error and OpenAPI vocabulary).
``node.validator.service.create_app`` builds the app and calls them.
"""
