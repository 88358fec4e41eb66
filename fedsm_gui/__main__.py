"""``python -m fedsm_gui``: same as the ``fedsm-gui`` command."""

from fedsm_gui.app import main

raise SystemExit(main())
