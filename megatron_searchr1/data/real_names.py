"""Real place names and common personal names that the synthetic world must not invent by chance.

Why: the world's names are syllable soup so that no pretrained model knows its facts; a drawn "Roma" or "Provo"
is a real place a model has read about, and a question about it could be answered (wrongly, or right by luck)
from memory instead of by searching. `synthetic.NameMaker` redraws any word in `REAL_NAMES`.

The list is shipped, not looked up at run time, so a world is the same bytes on every machine. It holds the
one-word parts (4-11 letters, lower case, accents dropped) of: every ISO 3166 country and subdivision name (taken
once from the `pycountry` data), and hand-picked lists of well-known cities and towns and of common given names
and surnames.
"""

REAL_NAMES = frozenset("""
    aargau aaron ababa abaco abad abauj abay abbes abel aberdeen abia abib abidjan abim abkhazia abra abruzzo
    abseron abuja abyan accra aceh acklins acores acquaviva acre adam adamaoua adamawa adams adan adana adazu addis
    addu adelaide adele adige adjumani adrar adrian adyaman adygeya aerodrom afar afghanistan africa african agadez
    agadir agago agalega agcabdi agdam agdas agder aghwar agion agnes agrigento agstafa agsu agua agusan ahafo ahal
    ahmad ahmadi ahmar ahmedabad ahras ahuachapan aichi aida aiga aigaio aileu ailuk aimeliik ainaro airai aires
    aisen aisne aiwo aizkraukles ajaria ajdovscina ajlun ajman akhdar akheti akita akkar aklan akmene akron aksaray
    akureyrarbr akwa alabama alagoas alajuela alan aland alaska alava alba albacete albania albany albay albert
    alberta alborz albuquerque alebtong aleppo alessandria alex alexander alexandria alger algeria algiers alibori
    alicante alice allen allier alma almaty almeida almeria alpes alsace alta altagracia altay altayskiy alto
    aluksnes alutaguse alvarez alytaus alytus alzette amacuro amambay amanat amanda amapa amara amarillo amasya
    amazonas ambeno amber amelia america american amman ammochostos amnat amolatar amos ampara amran amrun
    amsterdam amudat amuria amurskaya amuru anabar anaheim anambra anatoliki anbar ancash anchorage ancona
    andalucia andaman anderson andhra andijon andorra andraz andrea andres andrew andria andrijevica andros anenii
    anetan angad angaur angela anglesey angola anguilla angus anhalt anhui anibare anija anita anjouan anjra ankara
    ankaran anna annaba anne annie annobon ansaba anse antalya antarctica antigua antioquia antique antofagasta
    anton antrim antsiranana antsla antwerp antwerpen anyksciai anzoategui aomori aosta aousserd apac apace apai
    apayao appenzell april apskritis apure apurimac aqabah aqmola aqtobe aquila aquitaine arab arabia aracinovo
    arad aragacotn aragon aragua ararat arauca araucania arbil arborg arctic ardabil ardahan ardeche ardennes ards
    area arequipa arezzo argentina argentine arges argyll arhangay ariana arica ariege arima arizona arkansas
    arkhabil arkhangel arlington armagh armavir armenia armm armor arno arnold arous arreridj arta artemisa arthur
    artibonite artigas artvin arua aruba arunachal arusha asahreppur asaleleaga ascension ascoli asgabat ashanti
    asheville asimah asir assa assaba assam assilah astana astara asti asturias asuncion aswan asyut atacama
    atacora athens atlanta atlantico atlantida atlantique atlantiques atoll attapu attard attiki atua atyrau aube
    aubrey auckland aude audrey augusta aurora austin australes australia australian austria austurland autonoma
    autonomous auvergne avannaata aveiro avellino aveyron avila avtonomna avtonomnaya avtonomnyy awdal awsat
    ayacucho aydn ayeyarwady ayrshire ayutthaya azad azarbayjan azerbaijan azilal azua azuay baat baba babil babk
    bacau bacs badajoz badakhshan badakhshon baden badghis badji badulla bafata bagerhat baghdad baghlan bagmati
    bago baguirmi baha bahah bahama bahamas bahia bahr bahrain bahri baie bailey baitsi baja baker bakhtiari bakool
    baku balabak balah balaka balakn bale balears bali balkan balkarskaya balkesir balkh balochistan balqa balti
    baltimore baltistan baluchestan balvu balzan balzers bamako bamingui bamyan banaadir banbridge bandama
    bandarban bang bangalore banghazi bangka bangkok bangladesh bangoran bangui bani banjul bank banteay banten
    banwa baoruco barahona baranjska baranya barat barbados barbara barbuda barcelona barguna bari barima barinas
    baringo barishal barkah barking barlavento barletta barnes barnet barnsley barthelemy bartn basel basilan
    basilicata basrah bassa basse basseterre bassins bataan batanes batangas bath batha batinah batken batman batna
    batticaloa batys baucau bauchi bauskas bayadh bayan bayanhongor bayburt bayda bayelsa bayern bayrut bazar
    bazega beau bechar becker bedford beijing beirut beja bejaia bekes bekescsaba belait belarus belfast belfort
    belgium belgrade belitung belize bell bella bellona belluno beltinci bender benedikt benesov benevento benfro
    bengal bengkulu bengo benguela benguet beni benin benjamin bennett bennour benshangul benslimane benue beograd
    berane berat berbice berea bereg bergamo bergen berkane berkeley berkshire berlin bermuda bern bernard bernardo
    berne beroun berovo berrechid berry beth bethlehem betty bexley beyla beylqan bhola bhutan bianchi bicol biella
    bien bihar bihor bijagos bijelo bikini bilbao bilecik biliran bill billings billy bilogorska bilsuvar bimini
    bingol binh biobio bioko biombo biqa birgu birkirkara birmingham birstonas birzai birzebbuga bishkek biskra
    bismarck bissau bistrica bistrita bitlis bitola bizerte bizkaia bjelovarsko black blackburn blackpool blaenau
    blagoevgrad blake blansko blantyre bled blekinge blida bloke blue boaco bobonaro bocas boffa bogdanci bogota
    bogovinje bogura bohinj bohol boileau boise boke bokeo bolama boleslav bolikhamxai bolivar bolivarian bolivia
    bologna bolton bolu bolzano bombay bomet bomi bonaire bong bonnie bono bont boqueron bordeaux borders bordj
    borgarbygg borgo borgou boris borkou bormla borno borovnica borski borsod bosilovo bosne bosnia boston botha
    bothe botosani botswana bouaghi bouches boucle bouenza bougouriba bouira boujdour boulder boulemane boulgou
    boulkiemde boumerdes bourgogne bournemouth bouvet bouzid bovec bowyer boyaca boyd brabant bracknell brad
    bradford bradley braga braganca braila brakna branco brandenburg branicevski braslovce brasov brava brazil
    brazzaville brcko brda breclav bremen brenda brent brescia bresckaja brest bretagne brezice brezovica brian
    brianza briceni bridgend brighton brindisi brisbane bristol britain british brno brod brodsko brokopondo
    bromley brooke brooklyn brooks brown bruce brunei bruno brunswick bruntal brussels bruxelles brvenica bryan
    bryanskaya bryant buada bubanza bucharest bucuresti budaka budapest budejovice bududa budva bueng buenos
    buffalo bugiri bugle bugweri buhayrah buhweju buikwe bujumbura bukedea bukidnon bukomansibi bukwo bulacan
    bulambuli bulawayo bulgan bulgaria buliisa bumthang bundibugyo bungoma bunyangabu buraymi burdur burgas
    burgenland burgos buri burkina burns bursa burundi bururi bury buryatiya busan bushehr bushenyi busia butaleja
    butambala bute butebo butel butler butnan buvuma buxoro buxton buyende buzau caaguazu caazapa cabanas cabinda
    cabo caceres cacheu cadiz caen caerphilly cagayan cagliari cahul caicos caiman cair cairo cajamarca cakaudrove
    calabarzon calabria calais calarasi caldas calderdale caleb caledonia caledonie calgary cali california callao
    calvados calvin camaguey camarines cambodia cambridge camden cameroon camiguin camila campania campbell
    campeche campo campobasso canada canakkale canar canarias canaries canberra canelones canillo canindeyu cankova
    cankr cankuzo cannes cantabria cantagalo cantal cantemir canterbury canton cape capellen capisterre capital
    capitale capiz caqueta carabobo caracas caraga carajos caras carazo carchi cardiff cardoso cargados caribe carl
    carla carlo carlos carlow carmen carol carolina caroline carrara cartago carter carvalho casablanca casanare
    cascade cascades caserta casey caska castellon castelo castilla castillo castlereagh castries castro catalina
    catalunya catamarca catanduanes catania catanzaro catarina catherine cauca caue causeni causeway cavan cavite
    cayman cayo cayon cbrayl ceara cebu cecil celia celje centar central centrale centre centro ceredigion cerklje
    cerknica cerkno cerkvenjak cerro cesar cesena cesinovo ceska ceske cesky cess cesu cetinje ceuta chaam chaco
    chad chaguanas chahar chai chain chaiyaphum champasak chandigarh chandpur changhua chanthaburi chapai charente
    chargui chari charles charleston charlestown charlie charlotte charoen chatham chattogram chau chavez cheb
    chefchaouen chelsea chen chennai cher cherkaska cheshire chester chey chhnang chhukha chiang chiapas chiayi
    chiba chicago chichaoua chiesanuova chieti chihuahua chikwawa chile chimborazo chimbu chin china chinandega
    chinchipe chiquimula chiradzulu chiriqui chisinau chitipa chittagong chlef chloe choay chobe choco choiseul
    choluteca chomutov chon chongqing chontales chris christ christmas chrudim chtouka chuadanga chubut chukotskiy
    chumphon chuquisaca church chuuk chuy cibao cibitoke ciego cienfuegos cimislia cincinnati cirkulane citta city
    ciudad claire clara clare clarendon clark claro claude clervaux cleveland clilabad clipperton cluj coahuila
    coast cochabamba cocle cocos coimbra cojedes cole coleman colima colin colle collines collins cologne colombia
    colombo colon colonia colorado columbia columbus comayagua commewijne como comoe comore comoros comte comunidad
    conakry concepcion concord condamine congo connaught connecticut connor constanta constantine conti conwy cook
    cooper copan copenhagen copperbelt coquimbo cordillera cordoba corentyne cork cornwall coronie corozal correia
    correze corrientes corse cortes corum coruna cosenza costa cotabato cote cotes cotopaxi couffo county couva
    cova covasna coventry coyah craig craigavon crawford creek cremona crensovci creuse cristi cristobal criuleni
    crna crnomelj croatia crooked cross crotone croydon cruz csanad csongrad cuando cuanza cuba cubango cucer
    cuenca culfa cumbria cumilla cunene cuneo cunha cunningham curacao cuscatlan cusco cusio cusse cuvette cuyuni
    cynon cyprus czech czechia dabola dadra daegu daejeon dagana dagenham dagestan dahab dahuk daisy dajabon dakar
    dakhiliyah dakhla dakhlet dakota dalaba dalabygg dalarnas dale dali dallas dalmatinska daman damascus dambang
    dambovita danang daniel daniels danilovgrad dante daqahliyah darfur darhan darien darlington darnah darussalam
    darwen dasksn dasoguz daugavpils davao david davis dawa dawhah dawn daya daykundi dayr dayton dazur ddinbych
    dean debar debe debra debrca debrecen decin dedza defla deir delaware delcevo delgado delhi delta demerara
    demir democratic denguele denigomodu denis denizli denmark dennery denver derby derbyshire derek derry destrnik
    detroit deux devon devote dhaka dhakhirah dhamar dhexe diana diane dias diaz diber diego diekirch diffa digue
    dijon dikhil dili dimashq dinagat dinajpur dingli dinguiraye dios diourbel dire district distrikt distrito
    divaca dixon diyala diyarbakr djanet djelfa djellal djibloho djiboua djibouti dobeles dobje dobrepolje dobrich
    dobrna dobrova dobrovnik dodoma doha dojran dokolo dolenjske dolina dolj dolneni domagnano domazlice dome
    domingo domingos dominica dominican domzale doncaster donduseni donegal donetska donga dora dordogne doris
    dornava dornod dornogovi dorset dortmund dosso doubs douglas dover dowa down draa dragomer dravi dravograd
    dravskem drenthe dresden driouch drochia drome duarte dubai dubasari dubayy dublin dubois dubreka dubrovacko
    duchy dudley duluth dumfries dumyat dunaujvaros dundee dundgovi dunn duong duplek durand durango durazno durban
    durham durres dushanbe dutch duzce dylan dytiki dzavhan ealing east eastern ebon ebonyi echternach ecija
    ecuador edgar edinburgh edinet edirne edith edmonton edna edward edwards edwin eger egypt ehime eilean
    eindhoven ekiti elazg elbasan elektrenai elena eleuthera elgeyo elias elijah elisa eliya eliza elizabeth ella
    ellada ellen elliott ellis elsa elva emauga embera embu emil emilia emily emirates emma encamp enewetak enfield
    enga england english engordany enna ennedi enriquillo entre enugu equateur equatoria equatorial erevan eric
    erica erie erik eritrea ermera ernest erongo errachidia erzincan erzurum escaldes esch eschen escuintla esfahan
    eskisehir esmeraldas espaillat esparta espirito esposito essaouira essen essequibo essex essonne esteli estero
    esther estonia estuaire eswatini esztergom etela ethan ethiopia etoile eugene eure eustatius evan evans evelyn
    evora exotique extremadura exuma eyja eystra ezra faetano fahs falcon falesti falkirk falkland farah faranah
    fargo fargona faridpur faro faroe fars farwaniyah faryab faso fatick fayyum federacija federal federales
    federated federation federative fejer felidhu felix feng feni ferguson fermanagh fermo fernandez fernando
    ferrara ferrari ferreira fflint fgura fier fife figtree figuig fiji filipe finistere finland finnmark fiona
    fiorentino fira firenze fischer fisher fjallabygg fjarabygg flacq fleuri flevoland flintshire floahreppur
    florence flores floresti floriana florida fnideq foggia fogo fonoti fontana fontvieille foral ford forecariah
    forest forli formosa fort fortin foster fquih fram francaise francaises france franche francisco francistown
    frank frankfurt frankivska freda free freeman freeport freetown french fresno fria fribourg friuli frosinone
    frydek fryslan fuego fujayrah fujian fukui fukuoka fukushima fulham funafuti futuna fuvammulah fuzuli fynwy
    gabes gabon gabonese gaborone gabriel gabrovo gabu gaerfyrddin gafsa gaga gagauzia gaibandha gajnsielem
    galapagos galati galbeed galguduud galicia galle gallen gallo galloway galway gambela gambia gampaha gamprin
    gandaki gangwon gansu ganzourgou gaoual garabr garb garcia gard gardner gare gargur garissa garnier garonne
    gary gasa gasri gateshead gatshel gauteng gavin gavleborgs gaxaq gaza gazi gaziantep gazipur gbarpolu gdansk
    gdby gedaref gedeh gedo gegark geita gelderland general geneva geneve genoa genova george georgia gerais gerald
    germany gers gevgelija gewest gezira ghana ghanzi gharbi gharbiyah ghardaia ghat ghazal ghazni ghent ghor giang
    gibraltar gibson gifu gilan gilbert gilgit gina gingerland giordano gipuzkoa giresun girona gironde gisborne
    gishu gitega giulia giurgiu gjirokaster gjorce glacis glamorgan glarus glasgow glaud glens glodeni gloria
    gnagna goias golestan gomba gombe gomez gonzales gonzalez gopalganj gora goranboy goranska gordon gorenja
    gorenjskem gorgol gorica goricah gorisnica gorizia gorj gorje gornja gornji gorontalo gostivar gotalands
    gothenburg gotlands gourma govi goycay goygol gozo grace gracias grad gradec gradsko graham granada grand
    grande grandeanse granma grant graubunden gray graz great greater greco greece green greenland greenwich greg
    grenada grenadine grenadines gribingui griffin grimsnes groningen gros grosseto grosso grosuplje guadalajara
    guadalcanal guadeloupe guainia guaira guajira guam guanacaste guanajuato guangdong guangxi guantanamo guarda
    guarico guatemala guaviare guayas gudja guekedou guelma guelmim guera guercif guernsey guerrero guezzam guiana
    guidimaka guimaras guinea guizhou gujarat gulbenes gulf gulu gumaz gumushane guna gunma guria gusinje gutierrez
    guyana guyane gwangju gwangyeoksi gwent gwynedd gyeonggi gyor gzira haademeeste haapsalu habana habiganj
    hackney hacqabul hadjer hadramawt hailey hainan hainaut haiti hajdina hajdu hajeb hajjah hakkari halab haljala
    hall hallands halton hamadan hamah hambantota hamburg hame hamilton hamlets hammersmith hampshire hamra hanna
    hannah hanoi hanover hansen haouz harare harari harbour hardap harghita haringey harju harjumaa harku harold
    harris harrison harrow harry hart hartford hartlepool haryana hasakah hashemite haskovo hatay hato hatohobei
    haut haute hautes hauts havana haveli havering havlickuv hawaii hawalli hawke hawkins hayashi hayat hayes hayfa
    hazel heard hebei hebron hector hela helen helena helens hellenic helmand helsinki henan henderson henry hentiy
    herat herault herceg hercegovine hercule heredia hermanas herrera herzegovina hessen heves hhohho hicks hidalgo
    higgins highland highlands higuamo hiiraan hiiumaa hilda hill hillingdon himachal hims hincesti hirmil
    hiroshima hisar hlavni hoce hoceima hodh hodonin hodos hoek hoffman hoima hokkaido holguin holland holly holmes
    holstein holy homa homielskaja honduras hong honiara honolulu hoose hope hora horad horgarsveit horjul
    hormozgan hornafjorur houaphan houet hounslow houston hovd hove hovedstaden hovsgol howard howland hradec
    hradiste hrastnik hrpelje hsinchu hualien huambo huang huanuco hubei hudaydah hudud huelva huesca hughes hugo
    huila huizu hull hunabygg hunaing hunan hunedoara hung hungary hunt hunter huvadhu hyogo ialomita ialoveni iasi
    ibanda ibanez ibaraki ibom iceland idaho idlib idrija ifni ifrane ifugao iganga igdr ignacio ignalina ijuw
    iklin ilam ilfov ilhas ilinden ilirska iliyah ille illes illinois illizi ilocos iloilo imbabura imereti imisli
    imperia inagua incheon inchiri independent india indian indiana indonesia indre inezgane ingushetiya inhambane
    innerrhoden innlandet inoue insulaire intibuca inverclyde ioba ionia iowa ipeiros iqlim iran iraq irbid ireland
    irene iringa iris irkutskaya irvine isaac isabel isabela isafjararbr isere isernia ishikawa isingiro isiolo
    isla islamabad islamic island islands islas isle isles islet islington isma ismayll isparta israel istanbul
    istarska italian italy itapua itea ithaca ituri ivan ivancna ivano ivanov ivanovskaya ivindo ivoire iwate
    izabal izmir izola jabal jabat jablanicki jablonec jack jackson jacob jade jadid jadida jaen jafarah jaffna
    jahra jakangto jakarta jalal jalapa jalisco jaluit jamaica jamalpur jambi james jammu jamtlands jane janeiro
    janet janub janubi janubiyah japan jarash jardin jarva jarvamaa jarve jarvis jashore jason jasper jasz
    javakheti jawa jawf jazan jean jeddah jegunovce jeju jekabpils jelgava jelgavas jelsah jendouba jenin jenkins
    jenny jeollabuk jeollanam jerada jericho jerry jersey jerusalem jesenice jesenik jesse jezersko jhalakathi
    jharkhand jhenaidah jiangsu jiangxi jicin jigawa jihlava jihocesky jijel jilin jill jimenez jindrichuv jinja
    jinotega jiwaka jizah jizzax joan joel joelahtme joesuu jogeva jogevamaa john johnson johnston johor johvi
    jonas jonava jones jongkhar jonglei joniskis jonkopings jonubi jordan jose joseph joshua jowzjan joyce
    joypurhat juan jubbada judy jufrah jujuy julia julian julie jumhuri june juneau junin jura jurbarkas jurij
    jurmala jursinci justin jutiapa juventud juznobacki jwaneng kaabong kabale kabardino kabarole kaberamaido kabir
    kabul kacem kachin kadavu kadei kadiogo kadrina kaduna kaeb kaen kaeo kaeseong kaffrine kafr kagadi kagawa
    kagera kagoshima kainuu kairouan kaisiadorys kajiado kakamega kakumiro kalaki kalangala kalasin kalimantan
    kalinga kaliro kalkara kalmar kalmykiya kalungu kalutara kaluzhskaya kalvarija kambja kamchatskiy kamenica
    kamnik kampala kamphaeng kampong kampot kamuli kamwenge kanagawa kanal kanazawa kandaal kandahar kandy kanem
    kanepi kangweonto kankan kano kanpur kansas kanta kanungu kaoh kaohsiung kaolack kapchorwa kapelebyong kapija
    kapisa kaposvar kara karabuk karachayevo karachi karak karaman karas karbala karbinci kardzhali kareliya karen
    karenga karjala karl karlovacka karlovarsky karlovy karnali karnataka karnten karonga karpos kars kartli karuzi
    karvina kasai kasanda kasese kashmir kassala kasserine kastamonu kastre kasungu katakwi katanga katavi kate
    kathmandu katie kato katsina kaunas kauno kavadarci kavango kayah kayangel kayanza kayes kayin kayseri kayunga
    kazakhstan kazan kazlu kazo kebbi kebili kecskemet kedah kedainiai kedougou keeling keelung kegalla kehtna
    keila keith kekavas kelaa kelantan kelley kelly kelme kemo kenedougou kenitra kennedy kensington kent kentriki
    kentucky kenya kepulauan kerala kercem kericho kerman kermanshah kerouane kerry keryneia keski kevin keynes
    kgalagadi kgatleng khai khakasiya khammouan khams khan khanh khanty kharkivska khartoum khatlon khawr khaymah
    khemisset khenchela khenifra khersonska khiri khmelnytska khmum khomas khon khorasan khost khouribga khulna
    khuzestan khyber kiambu kibaale kiboga kibuku kicevo kidal kidricevo kien kiev kigali kigoma kihnu kiili
    kikuube kildare kili kilifi kilimanjaro kilinochchi kilis kilkenny kimura kindia king kingdom kingman kingston
    kinmen kinross kinshasa kiri kiribati kirinyaga kirklees kirkop kirkuk kirovskaya kiruhura kiruna kirundo
    kiryandongo kisela kishoreganj kisii kiskun kisoro kissidougou kisumu kitagwenda kitgum kitts kitui kivu kladno
    klaipeda klaipedos klatovy klbcr kneznou kngrli knight kninska knowsley kobarid kobayashi kobe kobilje koboko
    kocaeli kocani kocevje kochi kogi kohgiluyeh kohila kohtla kolasin kolda kole kolhumadulu kolin kolubarski
    komarom komen komenda komi kommune kommunia komondjari kompienga konce kong kongo konjice konya kopavogsbr
    koper koprivnicko korce kordestan kordofan korea koror koroskem kose koshi kosicky kosovo kosovski kosovsko
    kosrae kossi kostel kotayk kotido kotor kotto koubia kouilou koulikoro koulpelogo koundara kouritenga kouroussa
    kourweogo kowalski kozina kozje kozlov krabi kracheh kraj krakow kralove kranj kranjska krapinsko kraslavas
    kratovo kray kretinga kriti kriva krizevacka krizevci krki krkkale krklareli kromeriz kronobergs krsehir krsko
    krumlov krung krusevo krym kuala kudarat kufrah kuhistoni kujalleq kujawsko kukes kuldigas kumamoto kumanovo
    kumi kunar kunduz kunene kungota kupiskis kurdistan kurdmir kurganskaya kurigram kursk kurskaya kurunegala
    kushtia kutahya kutna kuusalu kuwait kuzma kvemo kwajalein kwale kwango kwania kwara kwazulu kween kweneng
    kwilu kyankwanzi kyegegwa kyenjojo kyiv kyivska kyle kymenlaakso kyotera kyoto kyrgyz kyrgyzstan kyustendil
    laane laanemaa laaneranna laayoune labe labem laborie labrador labuan lacn lacs ladakh ladhiqiyah laghman
    laghouat lagos laguna lagunes lahij lahore laikipia lakes lakshadweep lakshmipur lalmonirhat lambayeque lambeth
    lamis lampang lamphun lampung lamu lamwo lanao lanarkshire lancashire landes landschaft landskapet lang lanka
    lansing laois laos lappi lara larache laredo largo larnaka larue larvotto lasce lasko latina latvia laura
    lauren laurent lautem lavalleja laventille lawrence lazare lazdijai lazio leah lebanese lebanon lebap lebedev
    lecce lecco lechkhumi leeds lefebvre lefkosia leicester leinster leipzig leiria leitrim lekoumou lelouma lemba
    lemesos lempira lena lenart lendava leon leona leone leova leraba leribe lerik leroy lesotho leste lewis
    lewisham leyte lezhe lhuentse liam liang liaoning liberec liberecky liberia libertad libertador libya licko
    liege lienchiang liepaja lieu liguria lija likiep likoma likouala lila lille lilongwe lily lima limbazu limburg
    limerick limon limpopo lincoln linda lindi line linz lipa lipetskaya lipkovo liquica lira lisa lisboa lisbon
    lisburn lithuania litija litiji litomerice littoral livanu liverpool livorno ljubljana ljubljani ljubno
    ljutomer llave lleida lnkran lobata lobatse lobaye lodi lodz loei lofa logan logar logatec logone loir loire
    loiret lois loja loka loksa lola lolo lomaiviti lomami lombardia london long longford lopez lora lorenzo
    lorestan loreto lori loria loroum loska loski lothian louang louga louis louisiana louny lourdes lourenco louth
    lovech lovrenc lower lowland lozere lozovo lualaba luanda luapula lubbock lubelskie lubnan lubombo lubuskie
    lucas lucca luce lucia lucknow lucy ludzas luganuse lugo luhanska luis luke lukovica lumbini lumpur luna lund
    lunda luqa lusaka luton luuka luunja luwero luxembourg luxor luzern luzon lvivska lwengo lyantonde lydia lyon
    maan maardu maarja maarten mabel macao macedonia macenta macerata machakos machinga macon macoris macuata
    macvanski madaba madagascar madang madaripur madeira madhesh madhya madi madinah madison madonas madre madrid
    madriz mafeteng mafraq magallanes magdalena maggiore maguindanao magura magway maha mahaica mahajanga mahal
    maharashtra mahdia mahe mahrah mahwit maidenhead maine maio mairie majsperk majuro makamba makedonia makedonska
    makedonski makira makkah makole makueni malaga malaita malampa malange malatya malawi malaysia malbousquet
    maldives maldonado male mali malmo maloelap malta maluku malvinas mambere mamelles mamou manabi manafwa managua
    manatuto manawatu mancha manche manchester mancini mandalay mandera mandiana mandoul mangghystau mangochi
    mangrove manica manicaland maniema manikganj manila manipur manisa manitoba mannar manouba mansiyskiy mantova
    manufahi manus manyara manzini maopolskie maputo mara maracha maradi marahoue marakwet maramures maranhao
    marche marcos mardin mare margibi maria mariana marib maribor marie marijampole marina marinduque marino mario
    maritime maritimes mariy marj marjamaa mark markazi markovci marlborough marne marowijne marqab marrakech marsa
    marsabit marsaskala marsaxlokk marseille marshall marta martin martinez martinique marupes mary maryland masaka
    masall masaya masbate mascara maseru mashonaland masindi mason masqat massa massana masvingo matagalpa matale
    matam matanzas matara matera mato matruh matsumoto matteo maule mauren mauritania mauritius mavrovo maya
    mayabeque mayaguana mayaro mayen mayenne mayo mayor mayotte maysan mayuge mazandaran mazaruni mazeikiai
    mazowieckie mazurskie mbale mbarara mbeya mbomou mcdonald mchinji mdina mdiq mean meath mecklenburg medan medea
    medellin medenine medina mediouna medvode medway megan meghaier meghalaya mehedinti meherpur meimurska mejit
    meknes melaka melbourne melekeok melilla melissa mellal melliea melloul melnik memphis menaka mendes mendoza
    meneng menges meniaa merida mersch mersin merthyr merton meru mesa messina mesto meta metlika metohija
    metropole metz meurthe meuse mexican mexico meyer mezica mgarr miami miaoli michael michel michigan michoacan
    micoud micronesia middle midelt midlands midlothian midtjylland midway miestas migori miguel miklavz mila milan
    milano mili miller mills milne milo milton milwaukee mimaropa minas mindanao mindoro mingcevir minh minnesota
    minor minsk minskaja minufiyah minya miquelon mira mirabal miranda miren miriam mirna misamis misiones miskolc
    mislinja misratah mississippi missouri mistek mitchell mitooma mitrovacki mityana miyagi miyazaki mizoram mlada
    mobile modena mogila mohale mohammadia moheli mojkovac moka mokhotlong mokhtar mokronog moldova moletai molise
    molly mombasa mona monaco monagas monaghan monaragala monastir mondol moneghetti mongala monggar mongol
    mongolia monica mono monsenor mont montagnes montana monte montenegro monterrey montevideo montgomery montreal
    montserrado montserrat monza moore mopti moquegua morales moravce moravicki moravske moray morazan morbihan
    mordoviya moreau morelos moreno moresby morgan morgannwg morobe morocco morogoro morona moroto morris moscow
    moselle mosfellsbr moskovskaya moskva moslavacka moson most mosta mostaganem mosteiros mouhoun moulay moulins
    moulvibazar mount mountain mourne moxico moyen moyo mozambique mozirje mpigi mpoko mpumalanga mqabba msida
    mtarfa mtianeti mtskheta mtwara muara mubarak mubende muchinga mudug mugla muharraq muhu mukarramah mukdahan
    mukono mulaing mulaku mulanje mulgi mullaittivu muller mumbai munawwarah mundo munich munshiganj munster munxar
    muramvya murang murcia mures murmanskaya murphy murray murska murzuq musandam muscat muslim mustvee muta
    muthanna muyinga mwanza mwaro myanmar myers mykolaivska mymensingh mzimba naama nabatiyah nabeul nabilatuk
    nablus nachod nacional nadia nador nadroga nadu nadur naftalan nagaland nagano nagar nagasaki nagoricane nagoya
    nagykanizsa nagykun nahouri nairobi naitasiri najaf najran nakamura nakaseke nakasongola nakhon naklo nakuru
    nalut namangan namayingo namdrik namentenga namibe namibia namisindwa namosi nampho nampula namtha namu namur
    namutumba nana nancy nandi nang nangarhar nantes nantou nanumaga nanumea naogaon naomi napak naples napo napoli
    nara narail narathiwat narayanganj narino narok narsingdi narva naryn nasarawa nasaud nashville naso natal
    nathan national nations natore nauru navarra navassa navoiy navosa nawabganj naxcvan naxxar nayala nayarit
    nayok nazarje ndjamena ndombe neamt neath nebbi nebraska nedd neembucu neftcala negeri negotino negro negros
    neil nelson nenetskiy neno nepal neretvanska neringa netherlands netrakona neuchatel neuquen nevada nevis
    nevsehir newark newcastle newham newport newry ngabe ngai ngaraard ngarchelong ngardmau ngatpang ngchesar nghe
    ngiwal ngora ngounie ngozi nguyen niamey niari niassa nibok nicaragua nice nichola nichols nickerie nicobar
    nicolau nidwalden nievre nigde niger nigeria nigula niigata nikole niksic nilandhe nile nilphamari nimba nimroz
    nina ninawa ningxia ninh nippes nisavski nisia nisou nisporeni nistrului nithi nitriansky niuas niue niutao
    njombe nkhata nkhotakota noah noakhali nograd nohiyahoi noire nong nonthaburi noord nora nord nordeste
    nordjylland nordland nordrhein norfolk norma normandie noroeste norrbottens norte north northern northland
    northwest noruring norurland norway notio nottingham nouaceur nouadhibou nouakchott nouel noumbiel noun
    nouvelle nova novaci novads novak novara novi novo novy nowak nsanje ntcheu ntchisi ntem ntoroko ntungamo nuble
    nueva nuevo nugaal nukufetau nukulaelae nunavut nunes nuoro nuqat nuristan nusa nuwara nwoya nyamira nyandarua
    nyanga nyeri nyiregyhaza nymburk nzas nzerekore nzoia oakland oaxaca oblast oblesevo oblysy obock obongi
    obwalden ocampo occidental occitanie ocean ocnita ocoa ocotepeque odeska odessa odisha odranci odzkie oeste
    offaly ogden ogooue ogres ogun oguz ogwr ohangwena ohio ohrid oise oita okayama okinawa oklahoma okollo okrug
    olaines olancho oldham olfus olga olgiy olive oliveira oliver olivia olomouc olomoucky olson omagh omaha
    omaheke oman omar ombella ombre omnogovi omoro omsk omskaya omusati ondo ontario oost opava oplotnica opolskie
    oran orange ordino ordu ordubad orebro oregon orel orellana orgaos orhei orhon oriental orientales oristano
    orizari orkney orlando orlici orlovskaya ormoz orne oromia oros ortiz oruro osaka oscar osetiya oshana oshikoto
    osilnica osjecko oslo osmaniye ossola ostrava osun otago otdar otepaa ottawa otuke ouaddai ouaka ouargla
    ouarzazate oubritenga oudalan oudomxai oued oueme ouest ouezzane ouham oujda ouled ourense outlying ouzou
    overijssel ovorhangay owen owens oxford oxfordshire oyam ozama pablo pabna pader padova padua pafos pagegiai
    pahang paide paijat pailin pais pakhtunkhwa paki pakistan pakruojis paktika paktiya pakwach palangos palanka
    palau palauli palawan palencia palermo palestine pallisa palmas palmer palmetto palmyra pamela pampa pampanga
    panama panchagarh pando panevezio panevezys pangasinan panjshayr paola papua para paraguari paraguay paraiba
    paraiso paramaribo parana pardubice pardubicky parinacota paris parker parma parnu parnumaa paro part partial
    parwan pasadena pasco passore pastaza pasvalys patel pathom pathum patrick pattani patterson patuakhali paul
    paula paulo pavia pavlodar payne pays paysandu pazardzhik pcinjski pecki pecs pedernales pedro peggy pehcevo
    peipsiaare peleliu pelhrimov pema pemba pembroke penal penama pende penghu pengunungan penh peninsula
    penzenskaya people peoples peoria perak peravia pereira perlis perm permskiy pernambuco pernik perry
    persekutuan perth peru perugia pesaro pescara pesnica pest peten peter peterburg peters peterson petnjica petra
    petrov petrovci petrovec pfalz phalombe phangnga phanom phatthalung phatthaya phayao phet phetchabun
    phetchaburi phichit phikwe philip philippines phillips phitsanulok phnom phodrang phoebe phoenix phong
    phongsali phra phrae phuc phuket phuoc phyeongyang piacenza piarco piaui piceno pichincha piemonte pierce
    pierre pieta pina pinang pinar pingtung pins piper piran pirkanmaa pirojpur pirotski pisa pisek pistoia pita
    pitcairn pittsburgh piura pivka plaines plaisance planken plasnica plata plateau plateaux plav plenty pleven
    pljevlja plovdiv plunge pluzine plymouth plzen plzensky podcetrtek podgorica podlaskie podlehnik podravska
    podunavski podvelka pohja pohjanmaa pohjois pohnpei pohorju point pointe pokot polana poland polhov poljane
    poljcane polje polju polonnaruwa poltavska poltsamaa polva polvamaa polynesia polynesie polzela pomeroon
    pomoravski pomorskie poni pontevedra pool poole popov pordenone port portalegre porter portland porto
    portsmouth portugal portuguesa portuguese posavska postojna potaro potenza potok potosi pousaat powell powys
    pozesko prachatice prachin prachuap pradesh prague praha prahova praia prakan praslin prato preah prebold
    preddvor preilu prerov presidente presovsky pretoria prevalje prey pribram price prienai prilep primorskiy
    primorsko prince princes principado principe prizrenski probistip progreso prostejov provence providence
    providencia province provo pskovskaya ptuj puconci puducherry puebla pueblo puerto puglia pulau punakha pune
    punjab puno puntarenas putrajaya puttalam putumayo pyrenees qacha qadisiyah qahirah qala qalqilya qalyubiyah
    qaraghandy qash qashqadaryo qasim qatar qaywayn qazaqstan qazax qazvin qeqertalik qeqqata qina qinghai qobustan
    qormi qostanay qrendi quang quba qubadl quds quebec queensland queretaro quezon quiche quinara quindio quinn
    quintana quirino quito qunaytirah qusar quthing qyzylorda raasiku rabat race rach rachel radece radenci radgona
    radlje radovis radovljica radviliskis rafah ragged ragusa rajasthan rajbari rajshahi rakai rakhine rakovnik
    rakvere raleigh ralik ralph ramallah ramirez ramon ramos rangamati rangaring rangpur rankovce ranong rapina
    rapla raplamaa raqqah raseiniai raseon rasinski raski ratak ratchaburi ratchasima ratchathani ratnapura raul
    ravenna ravne raya raye raymah rayong rayyan razavi razgrad razkrizje reab reading real rebecca recica redange
    redbridge redcar redonda reed reef reggio regiao region rehamna reims relizane remich rempart rence rennell
    reno republic republika resen respublika retalhuleu reunion rewa reyes reykjanesbr reynolds rezekne rezeknes
    rezina rheinland rhin rhode rhondda rhone riau ribeira ribnica rica ricci rice richardson richmond rico riding
    rieng rietavas rieti riga rimini rioja rios risaralda riscani rita rivas river rivera rivers riviere rivnenska
    riyad rizal rize robert roberts robertson robin robinson rocha rochdale roche rodrigues rodriguez rogaland
    rogaska rogasovci rogatec rogers rokiskis rokycany roma romagna roman romana romania romano romblon rome romero
    romsdal rondonia rongelap ropazu roraima rosa roscommon rose rosoman ross rossi rostovskaya rostuse rotanak
    rotherham rotterdam rotuma rouen rouge rousse rovigo royale rozaje rubanda rubirizi ruby rudos rudy ruggell
    ruhnu ruiz rukiga rukungiri rukwa rumonge rumphi rural ruse russell russian russo rutana ruth rutland ruvuma
    ruyigi rwampara rwanda rwandese ryan ryangkangto ryazanskaya rychnov saarde saaremaa saarland saatl saba sabah
    sabha sabieh sabirabad sabran sabrina sachsen sacramento sadah sadie safi saga sagaing saha sahara sahbuz sahel
    said saida saint sainte saitama sakala sakarya sakhon sakia sakiai sakon saku salaam salah salaj salal
    salamanca salamat salaspils salavan salcininkai saldus sale salem salerno salfit salford salgotarjan salima
    sally salovci salta salto salvador salyan salzburg samana samangan samar samara samarqand samarskaya samax
    samburu samdrup samegrelo samoa samsun samtse samtskhe samuel samut samux sana sanaag sanchez sancti sanders
    sandevo sandra sandwell sandwich sandy sangha sangre sanguie sankt sankuru sanlurfa sanma sanmatenga sannat
    sant santa santander santarem santiago santo santos saone sapporo sara saraburi sarah saraj sarakham saramacca
    sarangani sarawak sardegna sarpang sarthe sasaki sassandra sassari satakunta satkhira sato satu satun satupa
    saudi saue saulkrastu savanes savannah savannakhet savanne savi savinji savnik savo savoie savona sawan sazavou
    scavnici schaan schleswig schmidt schneider schulz schwyz scilly scotia scotland scott scottish sdrk sean
    seattle sedhiou sefrou sefton segou segovia seibo seine sejong selangor selatan selenge selibe selma selnica
    selo semara sembabule sembilan semic semily semnan sempeter sencur sendai senegal senjska sennar seno sentilj
    sentjernej sentjur sentrupert seoul sepik serbia serena serere sergei sergipe sermersooq serravalle serua setif
    setomaa settat setubal sevastopol sever severin severnaya sevilla seville sevnica sevres seychelles sezana sfax
    shaanxi shaary shabeellaha shabwah shamal shamali shamaliyah shan shandong shanghai shanxi shariatpur shariqah
    sharqi sharqiyah shati shaw shaykh sheema shefa sheffield sheng sherpur shetland shida shiga shihaniyah shimal
    shimali shimane shinyanga shiselweni shizuoka shkoder shoals shomali shropshire shumen shyghys shymkent siar
    siauliai siauliu siaya sibensko sibiu sibugay sichuan sicilia sidama sidi sidorov siem siena sierra sigave
    siggiewi siguiri siguldas sihanouk siirt sikasso sikkim sila silale siliana silistra sillamae silute silva
    simiyu simmons simon simpson sina sinaloa sindh sing singapore singerei singida sinoe sinop sint sipaliwini
    siparia siparuni siquijor siracusa sirajganj sirak sirdaryo sironko sirvan sirvintos sisacko sissili sistan
    sivas siyzn sjlland skagabygg skagafjorur skagastrond skane skaya skeia skhirate skikda skiy skocjan skofja
    skofljica skuodas slaskie slatina slavonska sliema sligo slimane sliven slivnica slough slovak slovakia
    slovenia slovenj slovenska slovenske slovenskih smarje smarjeske smartno smiltenes smith smkir smolenskaya
    smolyan snfellsbr snyder sobota sochi soci socialist sodrazica sofala sofia sokolov sokoto solcava soldanesti
    solihull solola solomon solothurn soltustik somali somalia somerset somme somogy sondrio songkhla songkhram
    songwe sonia sonora sonsonate sonsorol sool sophia sopiste sopron soria soriano soroca soroti sorsogon sostanj
    sotavento sotli soufriere souk soum source sourou souss sousse south southampton southend southern southland
    southwark southwest souza sowa spain spanish special spelugues spencer spezia spiritus splitsko spokane spueu
    sraghna sredisce sremski srijemska srnak srpska srur stadt stann stara staro starse state states stavropol
    stefan steiermark stella stephen stephens sterea stevens stewart stinga stip stirling stockholm stockholms
    stockport stockton stoke stolitsa stone store strabane strakonice strandabygg straseni straza stredocesky
    struga strumica studenicani stueng stuttgart suceava sucre sucumbios sudan suffolk sughd suhaj suhbaatar
    sukhothai sulawesi sullivan sultan sultanate sulu sumadijski sumatera sumber sumperk sumqayt sumska sunamganj
    sunderland suomi supenaam suphan suqutra surat surigao surin suriname surrey surt surxondaryo susa susan sussex
    suto sutton suurland suurnes suurnesjabr suwayda suwayf suways suzuki svaay svalbard svaneti sven svencionys
    sveta sveti svitavy swansea sweden swieqi swindon swiss switzerland syddanmark sydney sylhet sylvia syria
    syrian syunik szabolcs szatmar szeged szekszard szolnok szombathely taakaev tabaquite tabasco tabor tabora
    tabuk tachira tachov tacna tacoma tacuarembo tadjourah tafea taff tafilah tafilalet tagant tahoua taichung
    tailevu tainan taipei taita taitung taiwan taizz tajikistan takahashi takamaka takhar takutu talas talbot tall
    tallinn talparo talsu tamanrasset tamaulipas tambacounda tambovskaya tameside tamil tampa tana tanaka tanane
    tandjile tang tanga tangail tanganyika tanger tangier tanintharyi tanzania taoudenit taounate taourirt taoyuan
    tapa tapoa tara taraba tarabulus taraclia taranaki taranto tarapaca tarf tarfaya targovishte tarija tarlac tarn
    tarnovo taroudannt tarrafal tarragona tartu tartumaa tartus tarxien tasman tasmania tata tatabanya tataouine
    tatarstan taurage taurages taveta tavus tawi taylor taza tbilisi tbong tearce tebessa tees tehran teixeira
    tekirdag telangana telemark telenesti teleorman telford telimele telsiai telsiu temara temburong temotu
    temouchent tenerife tengah tenggara tennessee teplice teramo terengganu teresa teritoriala terni ternopilska
    terres territoire territories territory teruel tete tetouan tetovo teukbyeolsi texas thaba thai thailand
    thakurgaon thames thammarat thanh thani thap tharaka thea thep thessalia thien thies thimphu thomas thompson
    thong thraki thua thuan thum thurgau thuringen thurrock thyolo tianjin tiaret tibesti ticino tien tierra tigrai
    tillaberi timimoun timis timor timur tina tindouf tinghir tinh tipaza tipperary tirane tiris tirol tisina
    tissemsilt tivat tizi tiznit tjer tlaxcala tlemcen toamasina tobago tobei tobias tocantins tochigi todd
    togdheer togo togolese toila tokat tokelau tokushima tokyo toledo toliara tolima tolmin tolna tomaz tombali
    tombouctou tome tomskaya tonga tongatapu tony topeka toplice toplicki torba torbay torfaen tori torino toro
    toronto tororo torres torva toscana toshkent totonicapan tottori touggourt tougue toulouse tours tovuz tower
    town toyama tozeur trabzon tracy traeng trafford trakai tran trang trani trans trapani trarza trashi trashigang
    trat trbovlje trebelno trebic trebnje treinta trelawny trenciansky trent trentino trento trenton tres treviso
    triesen triesenberg trieste trincomalee trinidad trinity tripoli tripura tristan trnavsky trndelag trnovska
    trojica troms trongsa trtr trujillo trutnov trzic trzin tsachilas tseka tshopo tshuapa tsirang tuamasaga tubas
    tucker tucson tucuman tudful tukuma tula tulcea tulkarm tulsa tumbes tunapuna tunas tunceli tungurahua tunis
    tunisia turi turin turkana turkistan turkiye turks turner turnisce tutong tuvalu tuyen tuzi tverskaya tydfil
    tyne tyneside tyumenskaya tyva uaboe uasin ubangi ubon ucar ucayali udine udmurtskaya udon uele uganda uherske
    uige ujae ujelang ukmerge ukraine ulaanbaatar ulawa ulcinj ulsan ulster ulytau umbria ungheni unik union
    unitatea united unity upon upper uppsala uqsur urbino ursula uruguay uruzgan usak ustecky usti usulutan utag
    utah utara utena utenos uthai utica utrecht utrik uttar uttaradit uttarakhand uusimaa uvea uygur uzbekistan
    vaduz vaike vaisigano vaitupu vakaga valais valandovo valcea valdesia vale valencia valenciana valentia valerie
    valga valgamaa valkas valladolid valle vallee valletta valley vallon valmieras valparaiso valverde vancouver
    vanuatu varaklanu varazdinska varena varese varmlands varna varsinais vary vasco vasilevo vaslui vasquez vastra
    vatican vaucluse vaud vaupes vava vavuniya vayoc veaeng vega velenje veles velika velike veliko vella vendee
    venera veneto venezia venezuela venice venkov ventspils vera veracruz veraguas verapaz verbano vercelli verde
    vermont verona verzej vestfirir vestfold vestland vestra vesturbygg vesturland veszprem vevcani viana vianden
    viangchan vibo vicente vicenza vichada vichy viciebskaja victor victoria videm vidin vienna vienne viet vietnam
    vieux vihear vihiga viii viimsi viken vila vilaine viljandi viljandimaa vilkaviskis villa ville vilniaus
    vilnius vincent vinh vinica vinni vinnytska viola violet vipava viqueque virgin virginia viroviticko viru
    virumaa visaginas visayas viseu vista vitanje viterbo vivian vizcaya vlaams vlaanderen vlore voblasc voda
    vodice vogar vogrsko vojnik vojvodina vologda volta volynska vorarlberg voreio vormsi vorpommern voru vorumaa
    vosges vrancea vransko vrapciste vratsa vrhnika vrtojba vsetin vukovarsko vung vuzenica vychod vyskov vysocina
    wade wadi wagner wahat waikato waini wajir wakayama wake wakefield wakiso wakrah wales walk walker wallace
    wallis wallon wallonne walsall walter waltham wanda wandsworth wang wangdue wanica ward wardak warminsko warrap
    warren warrington warsaw washington wasit watanabe waterford watson weaver webb weber wele wellington wells
    wendy west western westfalen westmeath westminster wexford whanganui white wichita wicklow wien wigan wight
    wilayah wilhems willa william williams wilson wiltshire wiltz windsor windward winnipeg wirral wisconsin
    wisniewski with wokingham woleu wood woods woqooyi worcester woroba wotho wotje wrekin wrexham wright wroclaw
    wurttemberg wusta wyatt wyoming xacmaz xagra xaignabouli xaisomboun xankndi xavier xbiex xekong xewkija xgajra
    xian xiii xinjiang xizang xocal xocavnd xorazm yacoub yagha yala yalova yamada yamagata yamaguchi yamalo
    yamamoto yamanashi yambol yang yangon yangtse yanovskaya yara yaracuy yardml yaren yasothon yatenga yazd yemen
    yevlax yevreyskaya yilan ynys yobe yogyakarta yokohama yomou yonkers yonne york yorkshire yoro yoshida young
    youssoufia yozgat ysyk ytra yucatan yukon yuma yumbe yunis yunlin yunnan yusuf yvelines zaayin zabaykal zabbar
    zabljak zabul zaby zacapa zacatecas zadarska zaghouan zagora zagorje zagorska zagreb zagrebacka zahirah zaire
    zajecarski zakarpatska zala zalec zambales zambezi zambezia zambia zamboanga zamfara zamora zanjan zanzan
    zanzibar zapad zaporizka zaqatala zara zaragoza zarasai zarqa zavrc zawiyah zawr zdar zealand zebbug zeeland
    zejtun zelenikovo zelezniki zelino zemmour zemo zemplen zeta zetale zhambyl zhang zhao zhejiang zhemgang zheng
    zhetisu zhou zhuangzu zhytomyrska ziguinchor zilinsky zimbabwe zinder ziri ziro zirovnica zizhiqu zlatiborski
    zlin zlinsky zngilan znojmo zochi zomba zombo zondoma zonguldak zora zoundweogo zrdab zrece zrnovci zufar zuid
    zulia zupa zupanija zurich zurrieq zuzemberk
""".split())
