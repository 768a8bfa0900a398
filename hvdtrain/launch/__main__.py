import sys

from hvdtrain.cli.launch import main

sys.exit(main())
