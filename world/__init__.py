"""A procedural world for training and testing the tiny model: shapes, colours, motion, backgrounds, sound, captions.

Everything is generated in code from a seed (nothing is downloaded): a scene
(shape, colour, motion, background) is captioned by a small grammar, rendered
to frames at 256x144 and 16 fps, and given a sound that follows it (a tone per
shape, an octave partial that rises with height, a click on every bounce).
"""
