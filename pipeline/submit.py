"""The file to hand to ``spark-submit``; its arguments are ``fleet-pipeline``'s::

    spark-submit --master yarn --deploy-mode client --py-files pipeline.zip \\
        pipeline/submit.py run all --from 2024-05-01 --to 2024-05-07 \\
        --landing hdfs:///fleet/landing --tables hdfs:///fleet/tables

The settings given to spark-submit (master, ``--conf``, spark-defaults.conf) win over the built-in small-machine
defaults, which apply only to a local master.
"""

import os
import sys

# run as a script, this file's directory is sys.path[0]: import the package from its parent instead
_here = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _here]
sys.path.insert(0, os.path.dirname(_here))

from pipeline.cli import main  # noqa: E402

raise SystemExit(main())
