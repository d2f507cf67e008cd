"""An example of bringing your own data and model to fedrod-ray: ``data`` writes an image folder with
natural clients, ``model`` holds a feature-extractor factory (``model.arch: fedrod_example.model:small_cnn``)."""
