from batchfit.cli import main

main()
