"""A small ResNet that tells eight shapes apart, as a user of spottrain would bring it.

``model.py`` is plain PyTorch (no spottrain import): the class you load the trained weights
into. ``data.py`` makes the images. ``task.py`` is the one file spottrain needs: ``build(ctx,
**task_args)`` returning a ``trainer.task.Task``. docs/bring-your-own-model.md walks through it.
"""
