"""Drop-ins for code written against another decoder: the change a user makes is one line.

    batch_decoder.py    ``BiCodecBatchDecoder``: the calls of an in-process batcher, served by
                        a shared server (or by a private one it starts in this process)

May import: ``client``, ``codecs``, ``protocol`` and ``errors``; and, only when asked to start a
private server in the calling process, ``server`` and ``model``. Importing it imports no torch.
"""
